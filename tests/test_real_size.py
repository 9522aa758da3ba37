"""klein-4B at real size on a CPU (issue 45): the layout built in its dtype, a model that does not fit refused at
start-up in one line, prompt embeddings bounded in bytes, and bench/real_size.py's code path at toy size."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from neuron_ui.model.footprint import meminfo_bytes, memory_problem, weight_bytes
from neuron_ui.model.runner import PipelineRunner
from neuron_ui.model.tiny import TINY, build_random_klein_pipeline, build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent


class Float32Shapes(TorchDispatchMode):
    """The shape of every float32 tensor an op makes while it is on."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.shapes.add(tuple(out.shape))
        return out


def test_the_layout_is_built_in_its_dtype_not_in_float32_and_cast():
    """Built in float32 and cast, klein-4B's text encoder alone took 16 GB: no weight may exist in float32 first."""
    with Float32Shapes() as made:
        pipe = build_random_klein_pipeline(torch.bfloat16, shape=TINY)
    modules = (pipe.text_encoder, pipe.transformer, pipe.vae)
    weights = {tuple(p.shape) for module in modules for p in module.parameters() if p.dim() >= 2}
    assert weights and not weights & made.shapes  # no float32 tensor of a weight's shape was ever allocated
    assert {p.dtype for module in modules for p in module.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # put back
    # from_pretrained would keep these in float32: none in these versions (a new one must be kept so here too)
    assert all(getattr(type(module), "_keep_in_fp32_modules", None) is None for module in modules)


def test_weights_are_counted_from_the_layout():
    """klein-4B is 32 GB in float32 and 16 GB in bf16, counted on the meta device; the tiny and a Hub id uncounted."""
    fp32, bf16 = weight_bytes("random-klein-4b", "float32"), weight_bytes("random-klein-4b", "bfloat16")
    assert fp32 == 2 * bf16 and 31e9 < fp32 < 33e9
    assert weight_bytes("tiny", "float32") is None and weight_bytes("owner/model", "float32") is None


def test_a_folder_is_counted_from_its_safetensors_headers(tmp_path):
    pipe = build_tiny_pipeline(torch.bfloat16)
    pipe.save_pretrained(tmp_path)
    saved = [t for name in ("transformer", "text_encoder", "vae") for t in getattr(pipe, name).state_dict().values()]
    fp32 = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in saved)
    assert weight_bytes(str(tmp_path), "float32") == fp32
    assert weight_bytes(str(tmp_path), "bfloat16") < fp32


def test_too_big_is_told_what_it_needs_and_what_to_pass_instead(tmp_path):
    """Past the machine's memory: refused, naming what fits. Past what is available now: told, and it goes on."""
    total, now = 24 * 2**30, 14 * 2**30
    assert memory_problem("random-klein-4b", "float32", total=total, available=now) == (
        True, "--model random-klein-4b in float32 needs 31.9 GB for its weights alone and this machine has 25.8 GB "
              "of memory: pass --dtype bfloat16 (its weights are 16.0 GB then)")
    assert memory_problem("random-klein-4b", "bfloat16", total=total, available=now) == (
        False, "--model random-klein-4b in bfloat16 needs 16.0 GB for its weights alone and 15.0 GB is available now: "
               "it may be killed for lack of memory unless other processes free some")
    assert memory_problem("random-klein-4b", "bfloat16", total=total, available=20 * 2**30) is None
    assert memory_problem("random-klein-4b", "bfloat16", total=8 * 2**30, available=8 * 2**30)[0] is True
    assert "on a machine with more" in memory_problem("random-klein-4b", "bfloat16", total=8 * 2**30)[1]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    assert meminfo_bytes("MemAvailable", meminfo) == 1000 * 1024
    assert meminfo_bytes("MemTotal", meminfo) == 24000000 * 1024
    assert meminfo_bytes("MemAvailable", tmp_path / "none") is None


def huge_folder(folder: Path) -> Path:
    """A diffusers folder whose transformer's header declares 400 TB of float32 (the file holds no data)."""
    (folder / "transformer").mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [10**7, 10**7], "data_offsets": [0, 0]}}).encode()
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header)
    (folder / "model_index.json").write_text("{}")
    return folder


def test_the_command_refuses_at_start_up_before_anything_is_built(tmp_path, capsys, environ):
    """The check is where the app and the command both load the model (serving.build_engine)."""
    from neuron_ui import cli

    folder = huge_folder(tmp_path / "model")
    assert cli.main(["generate", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompt", "x",
                     "--resolution", "256x256", "--out", str(tmp_path / "x.png"), "--cache-dir",
                     str(tmp_path / "cache")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith(f"error: --model {folder} in float32 needs 400000.0 GB for its weights alone")
    assert line.endswith("of memory: serve it on a machine with more")


def test_prompt_embeddings_are_bounded_in_bytes_too():
    runner = PipelineRunner(build_tiny_pipeline(), cache_size=8)
    one = runner.prompt_embeds("a").nbytes
    runner.cache_bytes = 2 * one + one // 2  # two fit, not three
    for prompt in ("b", "c", "d"):
        runner.prompt_embeds(prompt)
    assert list(runner._embeds) == ["c", "d"]
    runner.cache_bytes = one - 1  # not even one: nothing is kept
    runner.prompt_embeds("e")
    assert not runner._embeds


@pytest.mark.slow  # about 3 minutes on 2 loaded cores: two app starts, two child processes
def test_real_size_bench_runs_at_toy_size(tmp_path):
    out = tmp_path / "real_size.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "real_size.py"), "--small", "--folder",
                    str(tmp_path / "klein"), "--out", str(out)], cwd=ROOT, check=True, timeout=900)
    results = json.loads(out.read_text())
    assert not results["folder_written"]["skipped"] and not results["style_written"]["skipped"]
    for startup in (results["startup"], results["restart_startup"]):
        order = [startup[stage]["s"] for stage in ("listening", "read_from_disk", "ready")]
        assert order == sorted(order) and all(startup[s]["rss_gib"] > 0 for s in ("read_from_disk", "ready"))
    assert results["first_image"]["cache_event"] == "compiled" and results["first_image"]["compile_seconds"] > 0
    assert results["second_image"]["cache_event"] == "memory_hit"
    assert results["one_step_image"]["steps"] == 1 and results["per_step"]["per_step_s"] is not None
    assert len(results["previews"]["frames_at"]) == 2  # 3 steps: a frame after the second and third, then the image
    assert [s["style"] for s in results["style_on"]["style_switches"]] == ["real16"]
    assert [s["strength"] for s in results["style_strength"]["style_switches"]] == [0.5]
    assert [s["style"] for s in results["style_off"]["style_switches"]] == ["none"]
    assert results["grid"]["cells"] == 4 and results["grid"]["four_images_s"] > 0
    assert results["peak_rss_gib"] >= results["startup"]["ready"]["rss_gib"] > 0
    assert results["restart_image"]["run_seconds"] > 0
    plain = results["plain"]
    assert plain["plain_s"] > 0 and plain["transformer_gflop_per_step"] > 0 and plain["matmul_gflops"] > 0
    assert plain["engine_run_over_plain"] > 0
