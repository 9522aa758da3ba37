"""The benchmark scripts run end to end, at toy size on the CPU; their figures are for docs/performance.md only.

Each script's main(argv) runs in this process (a new Python costs 11-20 s of imports); decode_memory.py runs as its
command line, in a new process, as a user runs any of them.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_ui.config.cache_paths import NEFF_CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    """bench/<name>.py loaded as a module (bench/ is a folder of scripts, not a package), to call its main(argv)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cache_env(monkeypatch):
    """The cache variables a script's start-up sets in os.environ, restored after the test."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored-after-the-test")
    monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)


def test_gpu_script_runs_on_cpu_at_toy_size(tmp_path):
    out = tmp_path / "gpu.json"
    assert script("gpu_klein4b").main(["--device", "cpu", "--small", "--modes", "eager", "--resolutions", "256x256",
                                       "--runs", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["resolution"] == "256x256" and row["steps"] == 4
    assert row["image_s"] > row["step_s"] > 0
    assert row["transformer_tflop_per_step"] > 0 and row["achieved_tflops"] > 0


def test_benchmark_measures_what_the_app_adds_per_image_in_quick_mode(tmp_path, cache_env):
    """The overhead, 4-client throughput and stop-to-free sections, on one eager app at toy size."""
    out = tmp_path / "benchmark.json"
    assert script("benchmark").main(["--sections", "overhead,throughput,stop", "--resolution", "256x256", "--runs", "1",
                                     "--images", "4", "--long-steps", "30", "--compile", "eager", "--repeat", "2",
                                     "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["overhead"]["ratio_to_plain"]) == {"plain", "engine", "round_trip", "http_round_trip",
                                                          "engine_no_prompt_cache"}
    # Issue 22: each repeat of the overhead section is kept, with what each variant adds over the plain call in ms.
    runs = results["overhead_runs"]
    assert len(runs) == 2 and results["overhead"] in runs
    for run in runs:
        added = (run["median_s"]["round_trip"] - run["median_s"]["plain"]) * 1000
        # both sides rounded (seconds to 0.1 ms, the difference to 0.1 ms): they may differ by 0.1 ms at most
        assert run["added_ms"]["plain"] == 0 and abs(run["added_ms"]["round_trip"] - added) <= 0.1 + 1e-9
        for client in ("round_trip", "http_round_trip"):  # gradio_client's and plain HTTP's
            paired = run[f"{client}_paired_ms"]
            assert 0 < paired["spread"][0] <= paired["median"] <= paired["spread"][1]  # a round trip costs something
        assert set(run["png_write_ms"]) == {"uncompressed", "zlib_level_1"} and run["png_write_ms"]["uncompressed"] > 0
    assert results["targets"]["round_trip_added_ms"]["measured"] == [r["added_ms"]["round_trip"] for r in runs]
    throughput = results["throughput"]
    assert throughput["clients"] == 4 and throughput["images_per_s"]["clients"] > 0 < throughput["ratio"]
    stop = results["stop"]
    assert stop["step_s"] > 0 and set(stop["stop_to_next_start_s"]) == {"stop_endpoint", "job_cancel"}
    # Generous: the next request starts well before the stopped one would have finished its 30 steps.
    assert all(0 < seconds < 20 * stop["step_s"] + 2 for seconds in stop["stop_to_next_start_s"].values())
    assert set(results["targets"]) == {"round_trip_over_plain", "clients_throughput_over_plain_loop",
                                       "engine_no_prompt_cache_over_plain", "round_trip_added_ms",
                                       "round_trip_paired_ms", "http_round_trip_paired_ms"}


def test_decode_memory_bench_runs_at_toy_size(tmp_path):
    """The attack of issue 21 at toy size: every client answered, the memory figures read from the server."""
    out = tmp_path / "decode.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "decode_memory.py"), "--clients", "2", "--megapixels", "1",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["answers"] == {"complete": 2} and result["idle_rss_mb"] > 0
    assert {"peak_over_idle_mb", "after_over_idle_mb"} <= set(result)


def test_fair_turns_bench_prints_b_wait_and_throughput_at_toy_size(tmp_path, capsys):
    out = tmp_path / "fair_turns.json"
    script("fair_turns").main(["--queued", "3", "--steps", "2", "--rounds", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["command"].endswith("--rounds 1 --out " + str(out))
    assert [r["order"] for r in results["runs"]] == ["fifo", "fair"] and all(r["images"] == 4 for r in results["runs"])
    # At toy size the figures are noise; the order is not: first come first served makes B wait for A's queue.
    assert results["summary"]["fifo"]["b_wait_s"] > results["summary"]["fair"]["b_wait_s"]
    assert "B's wait with turns" in printed and results["busy_share_fair_over_fifo"] > 0


THROUGHPUT = {"resolution": "256x256", "clients": 4, "images_per_s": {"plain_loop": 2.0, "clients": 1.9}}
STOP = {"resolution": "256x256", "step_s": 0.05, "stop_to_next_start_s": {"stop_endpoint": 0.06, "job_cancel": 0.07}}


def test_the_chart_draws_the_sections_a_run_holds(tmp_path):
    """Issue 34: `--sections throughput,stop --out new.json` wrote its figures, then failed drawing ("Number of columns
    must be a positive integer, not 0", exit 1), since only overhead and compilation had panels."""
    from PIL import Image

    chart = script("benchmark").chart
    some = tmp_path / "some.png"
    assert chart({"date": "today", "throughput": THROUGHPUT, "stop": STOP}, some)
    with Image.open(some) as drawn:  # two panels, 6 inches each at 110 dpi
        assert drawn.size[0] == 2 * 6 * 110
    only_stop = tmp_path / "stop.png"
    assert chart({"stop": STOP}, only_stop) and Image.open(only_stop).size[0] == 6 * 110
    nothing = tmp_path / "nothing.png"
    assert not chart({"date": "today", "memory": {"ratio": 1.1}}, nothing) and not nothing.exists()


def test_bounds_bench_fills_each_store_to_its_bound_at_small_size(tmp_path):
    """Issue 45: every bound a stranger can fill, in bytes; --small runs the same sections at small sizes. The stores
    filled past their bounds keep no more than the bounds, in files and in bytes. In a process of its own, as it is
    run: it measures memory as the resident bytes an image adds, which memory this process freed earlier would hide."""
    out = tmp_path / "bounds.json"
    bench = ROOT / "bench" / "bounds.py"
    subprocess.run([sys.executable, str(bench), "--small", "--dir", str(tmp_path), "--out", str(out)], check=True,
                   timeout=600)
    r = json.loads(out.read_text())
    assert not list(tmp_path.glob("bounds-*"))  # its temporary folder is removed
    small, large = r["image_store"]
    for store in (small, large):
        assert store["saved"] > store["count_bound"] and store["files_kept"] <= store["count_bound"]
        assert store["bytes_on_disk"] <= max(store["byte_bound"], store["file_bytes"])
    assert small["files_kept"] == small["count_bound"]  # 8 small files fit the byte bound: the count holds them
    assert large["count_bound_times_file"] > large["byte_bound"] >= large["bytes_on_disk"]  # the byte bound holds
    assert large["files_kept"] == large["byte_bound"] // large["file_bytes"]
    for upload in r["uploads"]:  # filled until refused, within the budget
        assert upload["refused_with"] == 507 and upload["admitted"] >= 1
        assert upload["admitted"] * upload["upload_bytes"] <= upload["bytes_on_disk"] <= upload["budget"]
    held = r["held_results"]
    assert held["entries"] == 16 * 4 and 1000 < held["bytes_per_entry"] < 20_000  # a 2,000-character prompt each
    for preview in r["previews"]:
        assert preview["files_kept"] == preview["count_bound"] and preview["one_call_in_memory"] > 0
    for memory in r["in_memory"]:  # an RGB image is held at 4 bytes a pixel; resident memory is measured, so roughly
        width, height = map(int, memory["cell_pixels"].split("x"))  # a grid keeps each cell at its sheet size
        assert width <= 512 and height <= 512 and 4 * width * height <= memory["per_cell"] < 1.5 * 4 * width * height
    each, capped = r["stalled_downloads"]  # 4 clients that read none, each sent its file, then 2 at the cap
    assert (each["being_sent"], each["refused_503"], capped["being_sent"], capped["refused_503"]) == (4, 0, 2, 2)
    assert capped["server_rss_held"] < 2 * 3 * capped["piece_bytes"]  # about two pieces a download, no more
    bounds = {row["bound"] for row in r["table"]}
    assert {"image store", "held results", "uploads", "running grids' cells", "prompt cache"} <= bounds
    assert all(row["worst"] >= row["at_largest"] > 0 for row in r["table"] if row["bound"] != "image store")
