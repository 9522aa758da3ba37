"""Grids: the axes parsed and checked, the cells laid out and ordered, the sheet drawn (plain values, no engine),
and one grid on the tiny engine, where nothing compiles but the size's one graph."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from fakes import Painter, made_image
import torch
from PIL import Image, ImageFont
from runners import local_engine

from neuron_ui import cli
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.config.settings import Settings, build_parser, settings_from_args
from neuron_ui.studio.grid_plan import estimate_seconds, plan_grid
from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.results import EngineStatus, ShapeStatus
from neuron_ui.contract.stopping import Phase, Stopped, StopReason, StopToken
from neuron_ui.studio.grid_jobs import GridJobs, run_grid
from neuron_ui.studio.grid_sheet import FONT_SIZE, _fit, draw_sheet
from neuron_ui.engine.styles import StyleBook
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.lora_random import write_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline

PRESETS = parse_resolutions("256x256,512x512")
STYLES = {"ink": 0.8, "neon": 1.0}


def plan(**axes):
    axes.setdefault("seed", 7)
    return plan_grid(axes.pop("prompt", "a red fox in snow"), axes.pop("resolution", "256x256"), presets=PRESETS,
                     loaded=STYLES, **axes)


def test_seeds_as_a_list_or_a_count_from_a_start():
    assert plan(seeds="3,4").axes[0].values == (3, 4)
    assert plan(seeds="3+4").axes[0].values == (3, 4, 5, 6)
    assert plan(seeds=" 3 + 2 ").axes[0].labels == ("seed 3", "seed 4")


def test_prompt_variants_replace_the_first_in_the_prompt():
    grid = plan(prompts='fox,cat,"wolf, grey"')
    assert [c.prompt for c in grid.cells] == ["a red fox in snow", "a red cat in snow", "a red wolf, grey in snow"]


def test_the_sheet_lays_out_axes_across_down_and_in_blocks():
    grid = plan(seeds="1,2", styles="none,ink", steps="2,3")
    assert [a.name for a in grid.axes] == ["styles", "steps", "seeds"]  # columns, rows, blocks
    assert (grid.columns, grid.rows, grid.blocks, len(grid.cells)) == (2, 2, 2, 8)
    assert [(c.style, c.steps, c.seed) for c in grid.cells[:3]] == [(None, 2, 1), ("ink", 2, 1), (None, 3, 1)]
    last = grid.cells[-1]
    assert (last.column, last.row, last.block, last.seed, last.steps, last.style) == (1, 1, 1, 2, 3, "ink")


def test_the_run_order_switches_styles_the_fewest_times():
    grid = plan(styles="ink,none,neon", seeds="1,2", strengths="0.5,1")
    # on the sheet, styles change within every row; run, each style's (and strength's) cells come together
    looks = [c.look for c in grid.in_order()]
    assert looks == [("ink", 0.5)] * 2 + [("ink", 1.0)] * 2 + [(None, None)] * 4 + [("neon", 0.5)] * 2 + \
        [("neon", 1.0)] * 2
    assert grid.switches() == 4
    sheet_looks = [c.look for c in grid.cells]
    assert sum(a != b for a, b in zip(sheet_looks, sheet_looks[1:])) > grid.switches()


@pytest.mark.parametrize("axes, words", [
    ({"seeds": "1+17"}, "seeds' count must be a whole number from 1 to 16"),
    ({"seeds": "1,2,3,4", "steps": "1,2,3,4,5"}, "a grid of 5 steps x 4 seeds = 20 images is more than 16"),
    ({"styles": "none,chalk"}, "lora 'chalk' is not a style loaded here; allowed: none, ink, neon"),
    ({"seeds": "1,2", "resolution": "384x256"}, "resolution 384x256 is not a preset; allowed: 256x256, 512x512"),
    ({"prompts": "fox,,cat"}, "prompt variant 2 is empty"),
    ({"prompts": "dog,cat"}, "prompt variant 'dog' is not in the prompt"),
    ({"seeds": "1,x"}, "seed 'x' is not a whole number"),
    ({"steps": "0"}, "steps must be a whole number from 1 to 100"),
    ({"strengths": "0.5"}, "strengths are a style's strengths: give styles too"),
    ({"strengths": "3", "styles": "ink"}, "lora_scale must be a number from 0 to 2"),
    ({"seeds": "1", "steps": "1", "styles": "ink", "prompts": "fox,cat"}, "at most 3 axes; got 4"),
    ({}, "a grid needs an axis"),
    ({"seeds": "1,2\n3"}, "seeds has a line break: give its values on one line, comma-separated"),
    ({"prompts": "fox,cat\r"}, "prompts has a line break"),
    ({"steps": "1\r\n2"}, "steps has a line break"),
    ({"styles": "ink\nnone"}, "styles has a line break"),
    ({"styles": "ink", "strengths": "0.5,\n1"}, "strengths has a line break"),
])
def test_bad_axes_are_one_line_before_anything_runs(axes, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("+", r"\+")) as error:
        plan(**axes)
    assert "\n" not in str(error.value)


def test_a_number_is_an_axis_of_one_value():
    """/grid's steps=4 (a JSON number, not text) was refused: "steps must be text such as \"1,2\""."""
    assert plan(steps=4).axes[0].values == (4,) and plan(seeds=3.0).axes[0].values == (3,)
    assert plan(styles="ink", strengths=0.5).axes[1].values == (0.5,)
    with pytest.raises(ValueError, match="^steps must be text such as"):
        plan(steps=True)


class Measured:
    """The sheet's font, counting its measurements."""

    def __init__(self):
        self.font, self.count = ImageFont.load_default(size=FONT_SIZE), 0

    def getlength(self, text):
        self.count += 1
        return self.font.getlength(text)


@pytest.mark.parametrize("length", [2000, 8000])
def test_a_long_label_is_fitted_in_a_few_measurements(length):
    """A label was cut one character at a time, each cut measured: 12.9 s for 2,000 characters, 239 s for 8,000."""
    font, text = Measured(), ("a red fox in snow, " * length)[:length]
    start = time.perf_counter()
    label = _fit(text, font, 256)
    assert time.perf_counter() - start < 1.0 and font.count <= 16
    kept = label.removesuffix("…")
    assert label.endswith("…") and text.startswith(kept) and font.getlength(label) <= 256
    assert font.getlength(text[:len(kept) + 1] + "…") > 256  # the longest prefix that fits


def test_a_short_label_is_fitted_as_before():
    font = ImageFont.load_default(size=FONT_SIZE)
    for text in ("seed 3", "a red fox in snow at dusk, painted in ink", "WWWWWWWWWWWWWW iiiiiiiii AV To"):
        for width in (10, 60, 120, 174, 256):
            before = text  # the old fit: a character off at a time, until it fits
            if font.getlength(before) > width:
                while before and font.getlength(before + "…") > width:
                    before = before[:-1]
                before += "…"
            assert _fit(text, font, width) == before


def test_max_cells_is_a_parameter():
    assert len(plan(seeds="1+20", max_cells=20).cells) == 20


def status(latency: float | None, state=Phase.READY) -> EngineStatus:
    shapes = [ShapeStatus("256x256", "1:1", 256, state, last_latency=latency, estimate_seconds=30.0),
              ShapeStatus("512x512", "1:1", 1024, Phase.READY, last_latency=4.0)]
    return EngineStatus("tiny", "cpu", "float32", "regional", "eager", True, None, True, 4, 1.0, "", True, None,
                        False, shapes=shapes)


def test_the_estimate_scales_by_steps_and_adds_a_compile():
    grid = plan(steps="2,4")
    assert estimate_seconds(grid, status(2.0)) == pytest.approx(2.0 / 4 * 6)
    assert estimate_seconds(grid, status(None)) == pytest.approx(4.0 / 4 * 256 / 1024 * 6)  # another size's
    assert estimate_seconds(grid, status(2.0, Phase.COLD)) == pytest.approx(3.0 + 30.0)
    first = status(7.0)  # the size's first image: it compiled (5 s) and ran (2 s)
    first.shapes[0].compile_seconds = 5.0
    assert estimate_seconds(grid, first) == pytest.approx(2.0 / 4 * 6)
    first.shapes[0].hits = 1  # the last image came from memory: its time is all run
    assert estimate_seconds(grid, first) == pytest.approx(7.0 / 4 * 6)


@dataclass
class FakeEngine:
    """Records each generate call; never two at once (the grid is one request in the engine)."""

    stop_after: int = 99
    hold_at: int | None = None  # the call held (after its progress) until `released` is set or it is stopped

    def __post_init__(self):
        self.calls, self.busy, self.overlapped = [], threading.Lock(), False
        self.holding, self.released = threading.Event(), threading.Event()

    def generate(self, request, progress=None, stop=None):
        if not self.busy.acquire(blocking=False):
            self.overlapped = True
        try:
            if len(self.calls) >= self.stop_after:
                stop.stop()
                raise Stopped("stopped in the queue")
            self.calls.append(request)
            if progress:
                progress_update(progress)
            if len(self.calls) == self.hold_at:
                self.holding.set()
                woken = threading.Event()
                stop.listen(woken.set)
                while not (self.released.is_set() or stop.stopped):
                    woken.wait(0.05)
                if stop.stopped:
                    raise Stopped("stopped after step 1")
            return made_image(request, (len(self.calls) * 40 % 256, 90, 160))
        finally:
            self.busy.release()


def progress_update(progress):
    from neuron_ui.contract.results import ProgressUpdate

    progress(ProgressUpdate(Phase.DENOISING, "step 1 of 2", 0.5))


def test_cells_are_separate_requests_of_one_visitor_and_a_repeat_is_not_made_twice():
    engine, told = FakeEngine(), []
    grid = run_grid(engine, plan(styles="none,ink", strengths="0.5,1"), visitor="v", progress=told.append)
    # "none" at two strengths is one image: made once
    assert [(r.lora, r.lora_scale) for r in engine.calls] == [(None, None), ("ink", 0.5), ("ink", 1.0)]
    assert {r.visitor for r in engine.calls} == {"v"} and not engine.overlapped
    assert [c.same_as for c in grid.made] == [None, 0, None, None]
    assert [s["before_cell"] for s in grid.style_switches] == [1, 3]
    assert told[0].message == "image 1 of 4: step 1 of 2" and told[0].fraction == pytest.approx(0.125)


def test_stop_ends_the_rest_and_the_sheet_says_what_was_not_made(tmp_path):
    grid = run_grid(FakeEngine(stop_after=2), plan(seeds="1+4"))
    assert len(grid.made) == 2 and grid.stopped == "stopped in the queue; 2 of 4 images made"
    sheet = grid.image
    assert sheet.getpixel((sheet.width - 20, sheet.height - 20)) == (200, 200, 200)  # the last cell: not made
    with pytest.raises(Stopped):
        run_grid(FakeEngine(stop_after=0), plan(seeds="1+4"))


class ShuttingDown(FakeEngine):
    """The server drains (SIGTERM) after two cells: the next is refused as every new request is."""

    def generate(self, request, progress=None, stop=None):
        if len(self.calls) >= 2:
            raise EngineError("the server is shutting down; try again in a moment", ErrorKind.SHUTTING_DOWN)
        return super().generate(request, progress, stop)


def test_a_shutdown_mid_grid_ends_it_with_the_sheet_of_the_cells_made():
    job = GridJobs(ShuttingDown(), max_running=1).start("browser:a", plan(seeds="1+4"), finish=lambda grid: grid)
    assert job.wait(10) and job.failure is None
    assert job.outcome.stopped == "the server is shutting down; try again in a moment; 2 of 4 images made"
    assert job.outcome.image.width > 2 * 256  # its sheet, as a Stop's
    engine = ShuttingDown()
    engine.calls = [None, None]  # refused from its first cell: nothing to show, the error is the answer
    with pytest.raises(EngineError, match="shutting down"):
        run_grid(engine, plan(seeds="1+2"))


def test_the_jobs_wait_until_every_running_grid_has_ended_with_its_sheet():
    """What the server's drain waits for (server.py): a grid held on its second cell is still being made; once the
    engine refuses its next cell it ends, its sheet saved (`finish` ran), and the wait returns True."""
    engine = ShuttingDown(hold_at=2)
    jobs = GridJobs(engine, max_running=2)
    job = jobs.start("browser:a", plan(seeds="1+4"), finish=lambda grid: grid.stopped)
    assert engine.holding.wait(10)
    assert jobs.running() == 1 and jobs.wait(0) is False and job.outcome is None
    engine.released.set()  # the cell on the device finishes; the third is refused (the server is shutting down)
    assert jobs.wait(10) is True and jobs.running() == 0
    assert job.outcome == "the server is shutting down; try again in a moment; 2 of 4 images made"
    assert GridJobs(FakeEngine(), max_running=1).wait(0) is True  # none running: nothing to wait for


def test_a_grid_is_its_visitors_job_that_outlives_the_page_and_a_stop_ends_it():
    engine = FakeEngine(hold_at=2)  # the second cell is held
    jobs = GridJobs(engine, max_running=1)
    job = jobs.start("browser:a", plan(seeds="1+3"), finish=lambda grid: grid.stopped)
    assert engine.holding.wait(10)
    gone = StopToken()
    gone.stop(StopReason.DISCONNECTED)  # the page that started it went away (the gate's page-gone rule)
    assert job.follow(None, gone) is False and job.running and job.made == 1 and not engine.released.is_set()
    assert jobs.find("browser:a") is job and jobs.find("browser:b") is None and jobs.stop("browser:b") is None
    with pytest.raises(ValueError, match=r"^your grid of 3 at 256x256 is still being made \(1 done\): stop it, or "):
        jobs.start("browser:a", plan(seeds="1+2"), finish=lambda grid: len(grid.made))
    with pytest.raises(ValueError, match="^1 grids are being made on this server, its limit: try again when one"):
        jobs.start("browser:b", plan(seeds="1+2"), finish=lambda grid: len(grid.made))

    told, shown = [], threading.Event()  # a reloaded page of the same visitor watches it: the latest progress first
    watcher = threading.Thread(target=lambda: told.append(job.follow(lambda update: shown.set(), StopToken())))
    watcher.start()
    assert shown.wait(10)
    jobs.stop("browser:a")  # its Stop, from the reloaded page: the held cell stops, the third is never asked for
    watcher.join(10)
    assert told == [True] and job.outcome == "stopped after step 1; 1 of 3 images made" and len(engine.calls) == 2

    engine = FakeEngine(hold_at=2)  # the form's Stop cancels the watching event: that stops the grid too
    job = GridJobs(engine, max_running=1).start("browser:a", plan(seeds="1+3"), finish=lambda grid: grid.stopped)
    assert engine.holding.wait(10)
    cancelled = StopToken()
    cancelled.stop(StopReason.CANCELLED)
    assert job.follow(None, cancelled) is True and job.outcome == "stopped after step 1; 1 of 3 images made"


def test_a_grid_nobody_watches_finishes_and_is_kept_for_its_visitor_only_for_a_while():
    clock = [0.0]
    jobs = GridJobs(FakeEngine(), max_running=1, keep_seconds=60, max_kept=1, clock=lambda: clock[0])
    job = jobs.start("browser:a", plan(seeds="1+3"), finish=lambda grid: len(grid.made))
    assert job.wait(10) and job.outcome == 3 and job.made == 3 and job.ended == 0.0
    clock[0] = 59.0
    assert jobs.find("browser:a") is job
    other = jobs.start("browser:b", plan(seeds="1+2"), finish=lambda grid: len(grid.made))  # past max_kept: the
    # longest-ended goes
    assert other.wait(10) and jobs.find("browser:a") is None and jobs.find("browser:b") is other
    clock[0] = 120.0  # 60 s after it ended, no page can find it (its cells are in the history)
    assert jobs.find("browser:b") is None  # dropped: find() expires what is past its time


def test_the_sheet_has_labels_and_each_cell_in_its_png_text(tmp_path):
    grid = run_grid(FakeEngine(), plan(seeds="1,2", prompts="fox,cat"))
    path = grid.save_png(tmp_path / "grid.png", fast=True)
    image = Image.open(path)
    assert image.width > 2 * 256 and image.height > 2 * 256  # the cells, and room for the labels
    cells = [json.loads(image.text[f"cell {n}"]) for n in range(1, 5)]
    assert [(c["seed"], c["prompt"]) for c in cells] == [(1, "a red fox in snow"), (1, "a red cat in snow"),
                                                         (2, "a red fox in snow"), (2, "a red cat in snow")]
    assert cells[3]["parameters"]["seed"] == 2 and json.loads(image.text["grid"])["rows"] == 2
    label_strip = image.crop((0, 400, 150, 450)).convert("L")  # the second row's label, "seed 2", is drawn in ink
    assert min(label_strip.getdata()) < 100
    info = grid.info({0: "/images/a.png"})
    assert info["cells"][0]["image"] == "/images/a.png" and info["cells"][0]["cache_event"] == "memory_hit"


def full_size(heard):
    """Each cell's image as it was told to on_cell (a repeat: its earlier cell's), by cell index."""
    images = {done.cell.index: done.result.image for done in heard if done.same_as is None}
    return {done.cell.index: images[done.cell.index if done.same_as is None else done.same_as] for done in heard}


def test_a_running_grid_keeps_each_cell_at_its_sheet_size_and_draws_the_same_sheet():
    """A running grid held every image it made at full size until its sheet was saved: 17 grids of 100 cells at
    2048x2048 were 28.5 GB. Each cell is told at full size as it is made (the store saves it, the CLI writes it),
    then kept as the sheet draws it, at most 512 px a side; the sheet is the same, pixel for pixel."""
    heard = []
    grid_plan = plan_grid("a red fox in snow", "1152x896", presets=Painter.presets, loaded={}, seeds="1,1,2,3")
    grid = run_grid(Painter(), grid_plan, on_cell=heard.append)
    assert [done.result.image.size for done in heard if done.same_as is None] == [(1152, 896)] * 3
    assert [done.result.image.size for done in grid.made] == [(512, 398)] * 4  # 1152x896 scaled to 512 wide
    assert [done.result.info() for done in grid.made] == [done.result.info() for done in heard]  # the parameters
    assert np.array_equal(np.asarray(grid.image), np.asarray(draw_sheet(grid_plan, full_size(heard))))


def test_the_grid_and_ab_commands_write_each_cell_at_full_size_beside_the_same_sheet(tmp_path, capsys, environ):
    common = ["--model", "tiny", "--compile", "eager", "--resolutions", "1024x1024,1152x896", "--cache-dir",
              str(tmp_path / "cache"), "--prompt", "a grey heron", "--resolution", "1152x896"]
    engine = Painter()
    assert cli.main(["grid", *common, "--seeds", "5,5,6", "--out", str(tmp_path / "g.png")],
                    load=lambda settings: engine) == 0
    cells = json.loads(capsys.readouterr().out)["cells"]
    assert [Image.open(cell["image"]).size for cell in cells] == [(1152, 896)] * 3 and len(engine.calls) == 2
    grid_plan = plan_grid("a grey heron", "1152x896", presets=Painter.presets, loaded={}, seeds="5,5,6")
    drawn = draw_sheet(grid_plan, {index: Image.open(cell["image"]) for index, cell in enumerate(cells)})
    assert np.array_equal(np.asarray(Image.open(tmp_path / "g.png").convert("RGB")), np.asarray(drawn))
    assert cli.main(["ab", *common, "--a", "seed=5", "--b", "seed=6", "--out", str(tmp_path / "ab.png")],
                    load=lambda settings: engine) == 0
    info = json.loads(capsys.readouterr().out)
    assert Image.open(info["b"]["image"]).size == (1152, 896) and info["b"]["image"] == str(tmp_path / "ab-B.png")
    assert np.array_equal(np.asarray(Image.open(tmp_path / "ab-B.png")), np.asarray(Image.open(cells[2]["image"])))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny model with one style, a cache of its own and a per-visitor cap of 1."""
    torch._dynamo.reset()
    cache = configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})
    loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
    style = write_random_lora(loaded.pipe.transformer, tmp_path_factory.mktemp("styles") / "ink.safetensors", rank=2,
                              seed=1)
    yield local_engine(loaded, presets=PRESETS, compile_mode="regional", backend="eager", cache=cache,
                       manifest=CacheManifest(cache.manifest, error=cache.problem), max_queue_per_user=1,
                       styles=StyleBook.load([f"{style}@0.8"], loaded.pipe.transformer))
    torch._dynamo.reset()


def test_a_grid_on_the_engine_compiles_one_graph_and_switches_styles_once(engine):
    grid_plan = plan(seeds="1,2", styles="ink,none", steps="1")
    graphs = []  # dynamo's graphs once each cell is made: the first cell's compile made them all

    def counted(done):
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    with torch._dynamo.config.patch(error_on_recompile=True):  # a second graph for this size would fail the grid
        grid = run_grid(engine, grid_plan, visitor="one", on_cell=counted)  # 4 images, 1 waiting request allowed
    assert graphs[0] > 0 and graphs == [graphs[0]] * 4
    events = [c.result.cache_event for c in grid.made]
    assert events == ["compiled", "memory_hit", "memory_hit", "memory_hit"]
    assert [(c.cell.style, c.result.lora) for c in grid.made] == [("ink", "ink")] * 2 + [(None, None)] * 2
    assert grid.style_switches == [{"before_cell": 1, "from": {"style": "ink", "strength": None},
                                    "to": {"style": None, "strength": None}}]
    assert engine.status().shape("256x256").images == 4 and engine.status().shape("512x512").state == "cold"
    assert grid.made[0].result.image.size == (256, 256) and not grid.stopped


def test_the_grid_command_writes_the_sheet_and_each_cell_and_prints_the_info(engine, tmp_path, capsys, environ):
    argv = ["grid", "--model", "tiny", "--compile", "eager", "--resolutions", "256x256,512x512", "--cache-dir",
            str(tmp_path / "cache"), "--prompt", "a grey heron", "--resolution", "256x256", "--steps", "1"]
    code = cli.main([*argv, "--seeds", "3+2", "--styles", "none,ink", "--out", str(tmp_path / "g.png")],
                    load=lambda settings: engine)
    out, _ = capsys.readouterr()
    info = json.loads(out)
    assert code == 0 and [(c["seed"], c["style"]) for c in info["cells"]] == [(3, None), (4, None), (3, "ink"),
                                                                              (4, "ink")]
    assert len(info["style_switches"]) == 1 and info["out"] == str(tmp_path / "g.png")
    assert Image.open(info["cells"][3]["image"]).text["lora"].startswith("ink at 0.8")
    assert json.loads(Image.open(tmp_path / "g.png").text["cell 4"])["style"] == "ink"

    made = engine.status().shape("256x256").images
    code = cli.main([*argv, "--seeds", "1+5", "--steps", "1,2,3,4", "--max-grid-cells", "16",
                     "--out", str(tmp_path / "big.png")], load=lambda settings: engine)
    _, err = capsys.readouterr()
    assert code == 2 and err == "error: a grid of 4 steps x 5 seeds = 20 images is more than 16, this server's " \
        "limit (--max-grid-cells): take fewer values\n"
    assert not (tmp_path / "big.png").exists() and engine.status().shape("256x256").images == made  # nothing ran
    code = cli.main([*argv, "--seeds", "1,2\n3", "--out", str(tmp_path / "nl.png")], load=lambda settings: engine)
    assert code == 2 and capsys.readouterr().err == "error: seeds has a line break: give its values on one line, " \
        "comma-separated\n"


def test_max_grid_cells_is_a_flag_and_a_variable_within_bounds():
    assert Settings().max_grid_cells == 16
    assert settings_from_args(build_parser().parse_args(["--max-grid-cells", "40"]), environ={}).max_grid_cells == 40
    from_env = settings_from_args(build_parser().parse_args([]), environ={"NEURON_UI_MAX_GRID_CELLS": "8"})
    assert from_env.max_grid_cells == 8
    with pytest.raises(ValueError, match="--max-grid-cells must be 1 to 100, got 101"):
        Settings(max_grid_cells=101)


def test_the_panel_takes_each_kind_of_axis_once():
    from neuron_ui.ui.compare import NO_AXIS, axis_values

    assert axis_values("seeds", "1+2", NO_AXIS, "ignored", "steps", "1,2") == {"seeds": "1+2", "steps": "1,2"}
    with pytest.raises(ValueError, match="^seeds is chosen for two axes: pick each kind once$"):
        axis_values("seeds", "1", "seeds", "2", NO_AXIS, "")


class Measuring(FakeEngine):
    """The fake engine with a status: this size's last image took 2 s at the default 4 steps."""

    def status(self):
        return status(2.0)


def test_a_reloaded_pages_grid_line_follows_the_grid_and_counts_down_within_a_cell():
    from neuron_ui.studio.studio import Studio
    from neuron_ui.ui.compare import CompareHandlers, describe_running
    from neuron_ui.ui.session import HeldResults

    clock = [100.0]
    engine = Measuring(hold_at=2)  # the second of four cells is held
    job = GridJobs(engine, max_running=1, clock=lambda: clock[0]).start("browser:a", plan(seeds="1+4"),
                                                                        finish=lambda grid: None)
    assert engine.holding.wait(10) and job.made == 1 and job.since == 100.0
    # 8 s for the grid, 2 s an image: three to make, the one on the device counting down from its 2 s
    assert "1 of 4 made · about 6 s left (an estimate)" in describe_running(job, 8.0, 100.0)
    assert "about 5 s left" in describe_running(job, 8.0, 101.0)
    assert "about 4 s left" in describe_running(job, 8.0, 130.0)  # past its share: the two still to come
    assert "time left unknown" in describe_running(job, None, 101.0)
    engine.released.set()
    assert job.wait(10)

    # The page: a reload finds the grid running, its line timer starts, each tick re-renders the line, and once the
    # grid ends the tick stops the timer (the watch shows the sheet).
    engine = Measuring(hold_at=2)
    studio = Studio(engine)
    handlers, session = CompareHandlers(studio, HeldResults()), {"id": "a" * 22}
    job = studio.jobs.start(f"browser:{'a' * 22}", plan(seeds="1+3"), finish=lambda grid: None)
    assert engine.holding.wait(10)
    restored = handlers.on_restore(session)
    assert "1 of 3 made" in restored[1] and restored[3].active is True
    line, timer = handlers.on_line(session)
    assert "1 of 3 made" in line and "s left (an estimate)" in line
    engine.released.set()
    assert job.wait(10)
    line, timer = handlers.on_line(session)
    assert timer.active is False
