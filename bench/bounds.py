"""Every bound a stranger can fill, in bytes, at real image sizes (issue 45): each store filled to its bound with
noise images (what compresses least) at 1024x1024 and at the largest preset the app takes (2048x2048), built directly
as the tests build them; no model, no server. A few minutes on 2 cores, under 1 GB of memory and about 2.5 GB of
disk at a time, in a temporary folder removed at the end.

    python bench/bounds.py --out bench/results/bounds.json
    python bench/bounds.py --small --out /tmp/bounds.json   # seconds: small sizes and bounds, the same sections

Measured: the image store (files and bytes kept past its count and byte bounds), grid sheets, the held results of
1,024 browser sessions of 16 entries each (Python heap, tracemalloc), step previews, the upload budget, a running
grid's cells (run_grid on an engine that makes noise) and a queued request's input images (resident memory held,
psutil), and clients that ask for a 32 MiB file and read none, through the gate under uvicorn (raw sockets; the
server's resident memory, and the kernel's TCP memory from /proc/net/sockstat), with and without the gate's cap.
Computed, not measured: the prompt cache (its bound is in bytes already). Cited, from other runs: MCP sessions,
Gradio's per-session state.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import resource
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import FileResponse
from starlette.routing import Route

from neuron_ui.config.processes import free_port
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.config.settings import MAX_GRID_CELLS, Settings
from neuron_ui.contract.files import StoredFiles
from neuron_ui.contract.references import REFERENCE_SIZES
from neuron_ui.contract.requests import MAX_PROMPT_CHARS
from neuron_ui.contract.results import GenerateResult, StepPreview
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.model.runner import EMBEDS_BYTES
from neuron_ui.server.gate import Admission, Gate
from neuron_ui.studio.grid_jobs import run_grid
from neuron_ui.studio.grid_plan import DEFAULT_MAX_CELLS, plan_grid
from neuron_ui.studio.grid_sheet import CellResult, GridResult
from neuron_ui.web.gradio_mount import DOWNLOAD_PIECE, Mounted
from neuron_ui.ui.history import HistoryEntry
from neuron_ui.ui.session import HISTORY_SIZE, MAX_HELD, MAX_SESSIONS, HeldResults
from neuron_ui.web.files import KEEP_IMAGE_BYTES, KEEP_IMAGES, KEEP_PREVIEWS, ImageStore, PreviewFiles
from neuron_ui.web.uploads import UploadFolder

MB = 10**6
MIB = 2**20
PREVIEW_STEPS = 100  # a watched call holds at most one preview per step until it is read (STEPS' upper bound)
STALLED_FILE = 32 * MIB  # Gradio's largest own file, /static/ffmpeg/ffmpeg-core.wasm, which anyone may fetch
EMBEDS_ONE = 512 * 7680 * 2  # klein-4B's prompt embeddings: 512 tokens x 3 x 2560, bf16
GRADIO_SESSION_BYTES = 160_000  # Gradio's state per session for this UI (docs/operations.md: tracemalloc, earlier)
MCP_SESSION_BYTES = 63_000  # an MCP session (bench/results/mcp_sessions.json and docs/operations.md)


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"L": 1, "RGB": 3}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def result(image: Image.Image, seed: int = 7) -> GenerateResult:
    return GenerateResult(image=image, prompt="p" * MAX_PROMPT_CHARS, resolution=f"{image.width}x{image.height}",
                          steps=4, seed=seed, guidance=None, model="klein-4B", cache_event="memory_hit",
                          compile_seconds=0.0, run_seconds=1.0, total_seconds=1.0)


def folder_bytes(folder: Path) -> tuple[int, int]:
    """Files and their bytes under `folder` (links not followed)."""
    count = total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                count, total = count + 1, total + path.stat().st_size
    return count, total


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def map_large_buffers() -> None:
    """Buffers of 64 KiB and more from mmap, each handed back when freed (a fixed threshold turns glibc's adapting
    one off), so the resident memory an image adds is what it holds; off glibc, nothing (the figures are rougher)."""
    from neuron_ui.config.host_memory import M_MMAP_THRESHOLD, _glibc

    if (libc := _glibc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def held_rss(make) -> tuple[object, int]:
    """`make()`'s value and the resident bytes it holds (the RSS it adds while kept; see map_large_buffers)."""
    before = rss()
    value = make()
    return value, rss() - before


def image_store(work: Path, size: str, keep: int, keep_bytes: int) -> dict:
    """Saves past both bounds; what the store then keeps on disk, and what 512 files would be without the byte cap."""
    width, height = map(int, size.split("x"))
    made = result(noise(width, height))
    store = ImageStore(work / f"images-{size}", keep=keep, keep_bytes=keep_bytes)
    one = Path(store.folder / os.path.basename(store.save(made))).stat().st_size
    saves = max(keep, keep_bytes // one + 1) + 8
    start = time.perf_counter()
    for _ in range(saves - 1):
        store.save(made)
    files, on_disk = folder_bytes(store.folder)
    row = {"size": size, "file_bytes": one, "saved": saves, "files_kept": files, "bytes_on_disk": on_disk,
           "count_bound": keep, "byte_bound": keep_bytes, "count_bound_times_file": keep * one,
           "save_s": round((time.perf_counter() - start) / (saves - 1), 4)}
    shutil.rmtree(store.folder)
    return row


def grid_sheet(work: Path, size: str, cells: int) -> dict:
    """The sheet of a one-axis grid of `cells` cells at `size` (one seed repeated: one cell's file and the sheet)."""
    width, height = map(int, size.split("x"))
    plan = plan_grid("a red fox in snow", size, presets=parse_resolutions(size), loaded={}, max_cells=cells,
                     seeds=",".join(["7"] * cells))
    image = noise(width, height)
    grid = GridResult(plan, [CellResult(cell, result(image), None if cell.index == 0 else 0) for cell in plan.cells])
    sheet, sheet_rss = held_rss(lambda: grid.image)  # drawn on each read, as the store saves it
    store = ImageStore(work / f"sheets-{size}-{cells}", keep=4, keep_bytes=2**40)
    path = store.folder / os.path.basename(store.save(grid))
    row = {"size": size, "cells": cells, "sheet_pixels": f"{sheet.width}x{sheet.height}",
           "sheet_bytes_on_disk": path.stat().st_size, "sheet_bytes_in_memory": sheet_rss}
    del sheet
    shutil.rmtree(store.folder)
    return row


def held_results(store_paths: list[str], sessions: int, held: int) -> dict:
    """`sessions` sessions holding `held` entries each, a 2,000-character prompt each: the Python heap they take."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    results = HeldResults(max_sessions=sessions, max_held=held)
    for s in range(sessions):
        sid = secrets.token_urlsafe(16)
        for h in range(held):
            path = store_paths[(s * held + h) % len(store_paths)]
            text = f"{s}-{h} " + secrets.token_hex(MAX_PROMPT_CHARS // 2)[: MAX_PROMPT_CHARS - 12]
            info = f"1024x1024, seed {s * held + h}, 4 steps, memory_hit, 1.02 s; {secrets.token_hex(40)}"
            results.start(sid, "1024x1024")
            results.hold(sid, HistoryEntry(path, info, text, "1024x1024", s * held + h, 4, made=time.time(),
                                           references=(path, path)))
        results.fail(sid, f"an error line of about a hundred characters for session {sid}; try again later")
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(results) == sessions
    return {"sessions": sessions, "held_each": held, "entries": sessions * held, "heap_bytes": used,
            "bytes_per_entry": used // (sessions * held), "distinct_files_on_disk": len(set(store_paths))}


def previews(work: Path, size: str, keep: int) -> dict:
    width, height = (int(side) // 8 for side in size.split("x"))  # the latents' size
    (work / f"previews-{size}").mkdir()  # the app's is made by tempfile
    files = PreviewFiles(work / f"previews-{size}", keep=keep)
    preview = StepPreview(1, 4, width, height, noise(width, height).tobytes())
    for _ in range(keep + 8):
        files.save(preview)
    count, on_disk = folder_bytes(files.folder)
    shutil.rmtree(files.folder)
    return {"size": size, "preview_pixels": f"{width}x{height}", "png_bytes": len(preview.png()), "files_kept": count,
            "bytes_on_disk": on_disk, "count_bound": keep, "raw_bytes": len(preview.rgb),
            "one_call_in_memory": PREVIEW_STEPS * len(preview.rgb)}


def uploads(work: Path, size: str, budget: int) -> dict:
    """Noise PNGs uploaded (as Gradio writes them, `<sha256>/<name>`) until the budget refuses one."""
    width, height = map(int, size.split("x"))
    root = work / f"uploads-{size}"
    root.mkdir()
    folder = UploadFolder(root, budget, retention=600.0)
    path = root / "one.png"
    noise(width, height).save(path)  # PIL's default compression, as a browser's PNG
    data = path.read_bytes()
    path.unlink()
    admitted = 0
    while (refusal := folder.admit(len(data))) is None:
        stored = root / hashlib.sha256(f"{admitted}".encode() + data[:64]).hexdigest()
        stored.mkdir()
        (stored / "image.png").write_bytes(data)
        folder.done(len(data), 1)
        admitted += 1
    count, on_disk = folder_bytes(root)
    shutil.rmtree(root)
    return {"size": size, "upload_bytes": len(data), "admitted": admitted, "refused_with": refusal.status,
            "bytes_on_disk": on_disk, "budget": budget}


class NoiseEngine:
    """What run_grid calls of an engine: generate, here a noise image at the request's size."""

    def generate(self, request, progress=None, stop=None) -> GenerateResult:
        width, height = map(int, request.resolution.split("x"))
        return result(noise(width, height, seed=request.seed), seed=request.seed)


def in_memory(size: str, cells: int, references: int) -> dict:
    """A grid's made cells as it holds them until its sheet is saved (run_grid: each kept at the sheet's size), one
    image at full size (what each cell was held as before), and a queued request's fitted inputs, as resident bytes."""
    width, height = map(int, size.split("x"))
    plan = plan_grid("a red fox in snow", size, presets=parse_resolutions(size), loaded={}, max_cells=cells,
                     seeds=f"1+{cells}")
    grid, cells_rss = held_rss(lambda: run_grid(NoiseEngine(), plan))
    cell_pixels = f"{grid.made[0].result.image.width}x{grid.made[0].result.image.height}"
    del grid
    image, image_rss = held_rss(lambda: noise(width, height))
    del image
    ref = REFERENCE_SIZES[0]
    inputs, inputs_rss = held_rss(lambda: [noise(width, height), noise(width, height, "L")]
                                  + [noise(ref.width, ref.height, seed=i) for i in range(references)])
    del inputs
    return {"size": size, "grid_cells": cells, "cell_pixels": cell_pixels, "grid_cells_rss": cells_rss,
            "per_cell": cells_rss // cells, "full_image_rss": image_rss, "references": references,
            "reference_size": str(ref), "queued_inpaint_request_rss": inputs_rss}


@dataclass
class FileServer:
    """What the gate reads of the server (server/gate.py GateServer), of plain values: a file route only."""

    settings: Settings
    stored: StoredFiles
    uploads: object = None  # no uploads here
    mounted: Mounted = field(default_factory=lambda: Mounted(None, None, SessionStops()))  # no demo: files only
    draining: bool = False
    admission: Admission = field(default_factory=lambda: Admission(16))


class Pieces(FileResponse):
    chunk_size = DOWNLOAD_PIECE  # what gradio_mount sets for Gradio's file route


async def file_route(request) -> FileResponse:
    return Pieces(request.path_params["path"])


def tcp_memory() -> int:
    """The kernel's memory for every TCP socket on this machine (/proc/net/sockstat's pages); 0 off Linux."""
    try:
        line = next(line for line in Path("/proc/net/sockstat").read_text().splitlines() if line.startswith("TCP:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[-1]) * resource.getpagesize()


def settled(read, seconds: float = 20.0, quiet: int = 5) -> int:
    """`read()` once it stopped changing (the same `quiet` times in a row, 0.2 s apart), or after `seconds`."""
    deadline, last, same = time.monotonic() + seconds, read(), 0
    while same < quiet and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read()
        same, last = (same + 1, last) if value == last else (0, value)
    return last


def stalled_downloads(work: Path, clients: int, cap: int) -> dict:
    """`clients` that each ask for a STALLED_FILE through the gate under uvicorn and read none: what the server
    then holds (resident bytes, settled), the kernel's TCP memory for both ends, the downloads being sent and the
    refusals, with the gate's cap at `cap`."""
    path = work / "stalled.bin"
    if not path.exists():
        path.write_bytes(bytes(STALLED_FILE))
    gate = Gate(Starlette(routes=[Route("/gradio_api/file={path:path}", file_route)]),
                FileServer(Settings(model="tiny", max_downloads=cap), StoredFiles(work)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # uvicorn sets it once it listens
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    base, kernel_base = rss(), tcp_memory()
    sockets = []
    try:
        for _ in range(clients):
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(b"GET /gradio_api/file=stalled.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sockets.append(client)
        held = settled(lambda: rss() - base)
        sending = gate.downloading
        refused = sum(client.recv(12, socket.MSG_PEEK).startswith(b"HTTP/1.1 503") for client in sockets)
        kernel = tcp_memory() - kernel_base
    finally:
        for client in sockets:
            client.close()
        server.should_exit = True
        thread.join(30)
    return {"clients": clients, "cap": cap, "file_bytes": STALLED_FILE, "piece_bytes": DOWNLOAD_PIECE,
            "being_sent": sending, "refused_503": refused, "server_rss_held": held,
            "per_download": held // max(sending, 1), "kernel_tcp_bytes": kernel,
            "kernel_tcp_per_client": kernel // clients,
            "kernel_tcp_limit": tcp_limit()}


def tcp_limit() -> int:
    """The most memory the kernel gives TCP on this machine (tcp_mem's third value, in pages); 0 off Linux."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_mem").read_text().split()[2]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def table(r: dict, settings: Settings, largest: str) -> list[dict]:
    """One row per bound: the count bound, bytes at 1024x1024 and at the largest preset, where, the worst case."""
    store = {row["size"]: row for row in r["image_store"]}
    sheets = {(row["size"], row["cells"]): row for row in r["grid_sheets"]}
    prev = {row["size"]: row for row in r["previews"]}
    ups = {row["size"]: row for row in r["uploads"]}
    mem = {row["size"]: row for row in r["in_memory"]}
    held = r["held_results"]
    uncapped, capped = r["stalled_downloads"]
    queue, cells = settings.max_queue, r["grid_cells"]
    base = r["sizes"][0]
    pair = sheets[(largest, r["max_grid_cells"])]
    return [
        {"bound": "image store", "count": f"{store[base]['count_bound']} files", "where": "disk",
         "at_1024": store[base]["bytes_on_disk"], "at_largest": store[largest]["bytes_on_disk"],
         "worst": store[largest]["byte_bound"],
         "without_byte_cap": max(store[largest]["count_bound_times_file"],
                                 store[largest]["count_bound"] // 2
                                 * (pair["sheet_bytes_on_disk"] + store[largest]["file_bytes"]))},
        {"bound": "held results", "count": f"{held['sessions']} sessions x {held['held_each']}", "where": "memory",
         "at_1024": held["heap_bytes"], "at_largest": held["heap_bytes"], "worst": held["heap_bytes"]},
        {"bound": "step previews (files)", "count": f"{prev[base]['count_bound']} files", "where": "disk",
         "at_1024": prev[base]["bytes_on_disk"], "at_largest": prev[largest]["bytes_on_disk"],
         "worst": prev[largest]["bytes_on_disk"]},
        {"bound": "step previews (a watched call)", "count": f"{PREVIEW_STEPS} steps", "where": "memory",
         "at_1024": prev[base]["one_call_in_memory"], "at_largest": prev[largest]["one_call_in_memory"],
         "worst": prev[largest]["one_call_in_memory"]},
        {"bound": "uploads", "count": f"{ups[base]['admitted']} at 1024x1024", "where": "disk",
         "at_1024": ups[base]["bytes_on_disk"], "at_largest": ups[largest]["bytes_on_disk"],
         "worst": ups[base]["budget"]},
        {"bound": "running grids' cells", "count": f"{queue + 1} grids x {cells} cells", "where": "memory",
         "at_1024": (queue + 1) * cells * mem[base]["per_cell"],
         "at_largest": (queue + 1) * cells * mem[largest]["per_cell"],
         "worst": (queue + 1) * MAX_GRID_CELLS * max(mem[size]["per_cell"] for size in mem)},
        {"bound": "grid sheet", "count": f"{cells} cells ({MAX_GRID_CELLS} at most)", "where": "memory, then disk",
         "at_1024": sheets[(base, cells)]["sheet_bytes_on_disk"],
         "at_largest": sheets[(largest, cells)]["sheet_bytes_on_disk"], "worst": pair["sheet_bytes_on_disk"]},
        {"bound": "queued requests' inputs", "count": f"{queue} requests", "where": "memory",
         "at_1024": queue * mem[base]["queued_inpaint_request_rss"],
         "at_largest": queue * mem[largest]["queued_inpaint_request_rss"],
         "worst": queue * mem[largest]["queued_inpaint_request_rss"]},
        {"bound": "prompt cache", "count": "8 prompts", "where": "memory (the device's)",
         "at_1024": min(8 * EMBEDS_ONE, EMBEDS_BYTES), "at_largest": min(8 * EMBEDS_ONE, EMBEDS_BYTES),
         "worst": EMBEDS_BYTES},
        {"bound": "Gradio sessions (cited)", "count": "500 sessions", "where": "memory",
         "at_1024": 500 * GRADIO_SESSION_BYTES, "at_largest": 500 * GRADIO_SESSION_BYTES,
         "worst": 500 * GRADIO_SESSION_BYTES},
        {"bound": "MCP sessions (cited)", "count": f"{settings.mcp_sessions} sessions", "where": "memory",
         "at_1024": settings.mcp_sessions * MCP_SESSION_BYTES, "at_largest": settings.mcp_sessions * MCP_SESSION_BYTES,
         "worst": settings.mcp_sessions * MCP_SESSION_BYTES},
        {"bound": "stalled downloads", "count": f"--max-downloads {capped['cap']}", "where": "memory",
         "at_1024": capped["server_rss_held"], "at_largest": capped["server_rss_held"],
         "worst": capped["server_rss_held"],
         "without_cap": r["open_files_limit"] // 2 * uncapped["per_download"]},  # a socket and a file each
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small sizes and bounds: seconds, for the tests")
    parser.add_argument("--dir", default=None, help="where to write (a temporary folder inside it, removed)")
    parser.add_argument("--out", default="bench/results/bounds.json")
    args = parser.parse_args(argv)
    settings = Settings()
    if args.small:
        sizes, keep, keep_bytes, sessions, held = ["256x256", "512x512"], 8, 4 * 512 * 512 * 3, 16, 4
        budget, grid_cells, max_cells = 8 * MIB, 4, 9
        cap, stalled = 2, 4
    else:
        sizes, keep, keep_bytes, sessions, held = ["1024x1024", "2048x2048"], KEEP_IMAGES, KEEP_IMAGE_BYTES, \
            MAX_SESSIONS, MAX_HELD
        budget, grid_cells, max_cells = settings.upload_budget_mb * MIB, DEFAULT_MAX_CELLS, MAX_GRID_CELLS
        cap, stalled = settings.max_downloads, 2 * settings.max_downloads
    largest = sizes[-1]
    map_large_buffers()
    work = Path(tempfile.mkdtemp(prefix="bounds-", dir=args.dir))
    started = time.perf_counter()
    try:
        r: dict = {"sizes": sizes, "grid_cells": grid_cells, "max_grid_cells": max_cells,
                   "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
        # first, before the other sections leave freed memory to reuse
        r["in_memory"] = [in_memory(size, grid_cells, settings.max_references) for size in sizes]
        print("in memory", r["in_memory"], flush=True)
        r["image_store"] = [image_store(work, size, keep, keep_bytes) for size in sizes]
        print("image store", r["image_store"], flush=True)
        r["grid_sheets"] = [grid_sheet(work, size, cells) for size in sizes for cells in (grid_cells, max_cells)]
        print("grid sheets", r["grid_sheets"], flush=True)
        paths = [str(work / f"{n:05d}.png") for n in range(keep)]  # the store's files: at most `keep` distinct
        r["held_results"] = held_results(paths, sessions, held)
        print("held results", r["held_results"], flush=True)
        r["previews"] = [previews(work, size, KEEP_PREVIEWS) for size in sizes]
        r["uploads"] = [uploads(work, size, budget) for size in sizes]
        print("uploads", r["uploads"], flush=True)
        # each admitted (a cap above the clients: what the gate's cap prevents), then at the cap
        r["stalled_downloads"] = [stalled_downloads(work, stalled, stalled + 1), stalled_downloads(work, stalled, cap)]
        print("stalled downloads", r["stalled_downloads"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["table"] = table(r, settings, largest)
    r["history_size"] = HISTORY_SIZE
    r["seconds"] = round(time.perf_counter() - started, 1)
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    r["command"] = " ".join(["python", "bench/bounds.py", *(argv if argv is not None else sys.argv[1:])])
    r["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    r["date"] = time.strftime("%Y-%m-%d")
    for row in r["table"]:
        print(f"{row['bound']:32} {row['count']:36} {row['where']:22} 1024: {row['at_1024'] / MB:9.1f} MB  "
              f"largest: {row['at_largest'] / MB:9.1f} MB  worst: {row['worst'] / MB:10.1f} MB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
