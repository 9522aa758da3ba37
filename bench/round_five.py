"""Issue 46's closing runs, made as an attacker makes them: `python app.py --mcp` on the tiny model (CPU, eager, one
random style from `python -m neuron_ui lora random`) driven from outside over raw HTTP (httpx), gradio_client and
the `mcp` client, then a second app with `--replicas 2` for the previews; two minutes or so on 2 cores.

    python bench/round_five.py --out bench/results/round_five.json

1. labels: a 16-cell grid whose prompts axis makes 2,000-character prompts (each column's label), alone, the same
   grid with a short prompt, an /ab of the long prompt with replace=, then seven long grids at once with a
   gradio_client /generate sent meanwhile;
2. line breaks: a newline or carriage return in every axis of /grid and in /ab's replace=, through the raw call,
   gradio_client and MCP's tools; each answer's message and the log lines the app wrote for it;
3. abandoned streams: a 60-step /generate (previews on) and a 16-cell /grid posted to /gradio_api/call/<name>, their
   event stream closed after the first progress (a preview; the first cell made), a next request sent at once;
4. long names: GET /assets/ and /static/ with a 300-byte name;
5. previews through replicas: 40-step images with preview=True through gradio_client on `--replicas 2`.

The log is what the app wrote to stdout and stderr while a case was answered (bench/app_process.py); "Traceback"
counts its lines containing that word. Step counts after a closed stream are not visible from outside: they are
estimated from the next request's wait and the step time of a whole image made just before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio_client is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from gradio_client import Client  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is a folder of scripts, not a package

from app_process import AppProcess, tiny_app  # noqa: E402

SIZE = "256x256"
TIMEOUT = 600
GRID_AXES = ("seeds", "styles", "strengths", "steps", "prompts")  # /grid's order after prompt and resolution
BROKEN_AXIS = {"seeds": "1{}2", "styles": "none{}ink", "strengths": "0.5{}1", "steps": "1{}2", "prompts": "fox{}cat"}
BREAKS = {"newline": "\n", "carriage_return": "\r"}


class Log:
    """The app's log file: what it wrote since a mark, once it has had a moment to write it."""

    def __init__(self, path: Path):
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int, settle: float = 0.3) -> list[str]:
        time.sleep(settle)
        with self.path.open("rb") as f:
            f.seek(mark)
            return f.read().decode("utf-8", "replace").splitlines()


def written(lines: list[str]) -> dict:
    return {"log_lines": len(lines), "traceback_lines": sum("Traceback" in line for line in lines),
            "log_sample": [line[:200] for line in lines[:3]]}


def raw_call(url: str, name: str, data: list, on_event: Callable[[str, str], bool] | None = None,
             hold: Callable[[], None] | None = None) -> dict:
    """POST /gradio_api/call/<name>, then read its event stream until complete or error. The client goes away (closes
    the stream) where `on_event(event, data)` returns True, or, with `hold`, once the stream is open and `hold()` has
    returned, without reading it. The answer: event, data (parsed), seconds."""
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        posted = http.post(f"/gradio_api/call/{name}", json={"data": data})
        if posted.status_code != 200:
            return {"event": f"http {posted.status_code}", "data": posted.text[:300], "seconds": 0.0}
        event = None
        with http.stream("GET", f"/gradio_api/call/{name}/{posted.json()['event_id']}") as stream:
            if hold is not None:
                hold()
                return {"event": f"closed {stream.status_code} stream", "data": None,
                        "seconds": round(time.monotonic() - started, 3)}
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    body = line[5:].strip()
                    if event in ("complete", "error"):
                        return {"event": event, "data": json.loads(body) if body else None,
                                "seconds": round(time.monotonic() - started, 3)}
                    if on_event is not None and on_event(event, body):
                        return {"event": f"closed after {event}", "data": body[:300],
                                "seconds": round(time.monotonic() - started, 3)}
    return {"event": "stream ended", "data": None, "seconds": round(time.monotonic() - started, 3)}


def error_text(answer: dict) -> str:
    data = answer["data"]
    return str(data.get("error") if isinstance(data, dict) else data)


def metrics(url: str) -> dict[str, float]:
    """/metrics summed by name (labels dropped) and the stopped requests on their own."""
    sums: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if name.startswith('neuron_ui_errors_total{kind="stopped"'):
                sums["stopped"] = float(value)
            sums[name.split("{")[0]] = sums.get(name.split("{")[0], 0.0) + float(value)
    return sums


def long_prompt(chars: int) -> str:
    """Exactly `chars` characters with "fox" in it: the prompts axis fox,cat,owl,bee keeps each variant so long."""
    words = "a red fox in the snow at dusk, pine trees and soft evening light over a quiet valley"
    text = ""
    while len(text) < chars:
        text += words + ", "
    return text[:chars - 1] + "."


# 1. labels --------------------------------------------------------------------------------------------------------

def grid_times(answer: dict) -> dict:
    """A grid's answer: the request's seconds against its cells' own, the rest (the sheet, labels, the answer)."""
    if answer["event"] != "complete":
        return {"answer": answer["event"], "error": error_text(answer), "seconds": answer["seconds"]}
    info = answer["data"][1]
    cells = sum(cell["seconds"] for cell in info["cells"])
    rest = answer["seconds"] - cells
    return {"answer": "complete", "cells": len(info["cells"]), "request_seconds": answer["seconds"],
            "grid_seconds": info["seconds"], "cells_seconds": round(cells, 3), "rest_seconds": round(rest, 3),
            "rest_share": round(rest / answer["seconds"], 3),
            "label_chars": [len(label) for axis in info["axes"] for label in axis["labels"]][:4]}


def ab_times(answer: dict) -> dict:
    """An A/B's answer: the request's seconds against its two images' own, and its labels' length."""
    if answer["event"] != "complete":
        return {"answer": answer["event"], "error": error_text(answer), "seconds": answer["seconds"]}
    info = answer["data"][1]
    return {"answer": "complete", "request_seconds": answer["seconds"],
            "cells_seconds": round(info["a"]["seconds"] + info["b"]["seconds"], 3),
            "label_chars": [len(label) for label in info["labels"]]}


def labels(app: AppProcess, client: Client, burst: int) -> dict:
    """The long-prompt grid and A/B alone, the short-prompt grid, then `burst` long grids with a /generate meanwhile."""
    long = long_prompt(2000)
    grid = [SIZE, "1+4", None, None, None, "fox,cat,owl,bee"]  # 4 prompts x 4 seeds, the model's 4 steps
    alone = {"long_prompts": grid_times(raw_call(app.url, "grid", [long, *grid])),
             "short_prompts": grid_times(raw_call(app.url, "grid", ["a red fox in the snow", *grid])),
             "ab_long_prompt": ab_times(raw_call(app.url, "ab", [long, SIZE, None, "replace=fox,cat"]))}
    answers: list[dict] = [{}] * burst

    def one(i: int) -> None:
        answers[i] = raw_call(app.url, "grid", [long, SIZE, f"{100 + 4 * i}+4", *grid[2:]])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the first grid is on the device, the others waiting
    started = time.monotonic()
    try:
        _, info = client.predict("a lighthouse", SIZE, 4, 7, api_name="/generate")
        second = {"answer": "complete", "seconds": round(time.monotonic() - started, 3),
                  "waited_seconds": info.get("waited_seconds"), "total_seconds": info.get("total_seconds")}
    except Exception as error:  # noqa: BLE001 - what the client was told is the figure
        second = {"answer": "error", "error": str(error), "seconds": round(time.monotonic() - started, 3)}
    for thread in threads:
        thread.join()
    burst_times = [grid_times(answer) for answer in answers]
    full = sum("Queue is full" in json.dumps(answer["data"]) for answer in answers)
    cost = (alone["long_prompts"].get("rest_seconds", float("nan"))
            - alone["short_prompts"].get("rest_seconds", float("nan")))
    return {"prompt_chars": len(long), "grid": "prompts fox,cat,owl,bee x seeds 1+4 = 16 cells", **alone,
            "long_labels_cost_seconds": round(cost, 3),  # the long grid's rest less the short one's
            "burst": {"grids": burst, "answers": [t["answer"] for t in burst_times],
                      "request_seconds": [t.get("request_seconds") for t in burst_times],
                      "queue_full": full + ("Queue is full" in second.get("error", "")),
                      "second_request_gradio_client_generate": second}}


# 2. line breaks ---------------------------------------------------------------------------------------------------

def refusal(door: str, message: str, lines: list[str], refused: bool) -> dict:
    return {"door": door, "refused": refused, "message": message, "one_line": "\n" not in message
            and "\r" not in message, **written(lines)}


def line_break_cases() -> list[tuple[str, str, dict[str, str]]]:
    """(endpoint, case, its arguments by name): every axis of /grid and each side of /ab's replace=, each break."""
    cases = []
    for word, char in BREAKS.items():
        cases += [("grid", f"{axis} {word}", {axis: BROKEN_AXIS[axis].format(char)}) for axis in GRID_AXES]
        cases += [("ab", f"{side} replace= {word}", {side: f"replace=fox{char}cat", other: "seed=5"})
                  for side, other in (("a", "b"), ("b", "a"))]
    return cases


def line_breaks(app: AppProcess, client: Client, log: Log) -> dict:
    prompt = "a red fox in the snow"
    rows = []
    for endpoint, case, given in line_break_cases():
        names = GRID_AXES if endpoint == "grid" else ("a", "b")
        mark = log.mark()
        answer = raw_call(app.url, endpoint, [prompt, SIZE, *(given.get(name) for name in names)])
        rows.append({"case": f"/{endpoint} {case}", **refusal("raw /gradio_api/call", error_text(answer),
                                                                log.since(mark), answer["event"] == "error")})
        mark = log.mark()
        try:
            client.predict(prompt, SIZE, **given, api_name=f"/{endpoint}")
            message, refused = "answered", False
        except Exception as error:  # noqa: BLE001 - the refusal is the figure
            message, refused = str(error), True
        rows.append({"case": f"/{endpoint} {case}", **refusal("gradio_client", message, log.since(mark), refused)})
    rows += asyncio.run(mcp_line_breaks(app.url, log, prompt))
    return {"cases": len(rows), "all_refused": all(r["refused"] for r in rows),
            "all_one_line": all(r["one_line"] for r in rows),
            "log_lines_max": max(r["log_lines"] for r in rows),
            "traceback_lines": sum(r["traceback_lines"] for r in rows),
            "messages": sorted({r["message"] for r in rows}), "rows": rows}


async def mcp_line_breaks(url: str, log: Log, prompt: str) -> list[dict]:
    """The same cases through MCP's grid and ab tools (the app has a style loaded: the grid tool lists every axis)."""
    rows = []
    async with (httpx.AsyncClient(timeout=TIMEOUT) as http,
                streamable_http_client(url + "/gradio_api/mcp/", http_client=http) as (read, write, _),
                ClientSession(read, write) as session):
        await session.initialize()
        listed = {tool.name: set(tool.inputSchema["properties"]) for tool in (await session.list_tools()).tools}
        for endpoint, case, given in line_break_cases():
            mark = log.mark()
            result = await session.call_tool(endpoint, {"prompt": prompt, "resolution": SIZE, **given})
            message = " | ".join(getattr(part, "text", part.type) for part in result.content)
            lines = await asyncio.to_thread(log.since, mark)
            rows.append({"case": f"/{endpoint} {case}", **refusal("mcp tool", message, lines, result.isError),
                         "in_tool_schema": set(given) <= listed[endpoint]})
    return rows


# 3. abandoned streams ---------------------------------------------------------------------------------------------

def abandoned(app: AppProcess, log: Log) -> dict:
    whole = raw_call(app.url, "generate", ["a lighthouse", SIZE, 60, 1, None, None, None, None, None, True])
    run = whole["data"][1]["run_seconds"]
    step = run / 60
    seen: list[int] = []

    def first_preview(event: str, body: str) -> bool:
        if event == "generating":
            seen.append(json.loads(body)[1]["preview"]["step"])
        return bool(seen)

    generate = walk_away(app, log, "generate", ["a lighthouse", SIZE, 60, 2, None, None, None, None, None, True],
                         first_preview)
    generate.update(steps_seen_before_close=seen[-1] if seen else 0,
                    steps_run_at_most=round((seen[-1] if seen else 0) + generate["next_wait_seconds"] / step, 1))
    before = metrics(app.url)["neuron_ui_images_total"]

    def first_cell() -> None:  # the raw stream carries no progress before the sheet: /metrics counts the cells
        while metrics(app.url)["neuron_ui_images_total"] == before:
            time.sleep(0.05)

    grid = walk_away(app, log, "grid", ["a heron", SIZE, "41+16", None, None, "20", None], hold=first_cell)
    return {"whole_60_step_image": {"seconds": whole["seconds"], "run_seconds": run, "step_seconds": round(step, 4)},
            "generate_60_steps_preview": generate, "grid_16_cells": grid}


def walk_away(app: AppProcess, log: Log, name: str, data: list, until: Callable[[str, str], bool] | None = None,
              hold: Callable[[], None] | None = None) -> dict:
    """Post `data` to /gradio_api/call/<name>, close its stream where `until` or `hold` says (raw_call), send a 4-step
    image at once: its wait (its seconds less its own making) is how long the device stayed with the work nobody
    reads."""
    before, mark = metrics(app.url), log.mark()
    closed = raw_call(app.url, name, data, until, hold)
    answer = raw_call(app.url, "generate", ["a next visitor", SIZE, 4, 9, None, None, None, None, None, None])
    after, lines = metrics(app.url), log.since(mark)
    info = answer["data"][1] if answer["event"] == "complete" else {}
    grid_line = next((line for line in lines if "grid_jobs: grid of" in line), None)
    made = re.search(r": (\d+) made", grid_line or "")
    return {"closed": closed["event"], "closed_after_seconds": closed["seconds"],
            "next_answer": answer["event"], "next_request_seconds": answer["seconds"],
            "next_wait_seconds": round(answer["seconds"] - info.get("total_seconds", 0), 3),
            "next_engine_waited_seconds": info.get("waited_seconds"),
            "stopped_requests": after.get("stopped", 0) - before.get("stopped", 0),
            "images_made": after["neuron_ui_images_total"] - before["neuron_ui_images_total"] - 1,  # less the next
            "grid_cells_made": int(made.group(1)) if made else None, "grid_log_line": grid_line and grid_line[24:],
            "device_busy_after": after["neuron_ui_device_busy"], "queue_depth_after": after["neuron_ui_queue_depth"],
            **written(lines)}


# 4. long names ----------------------------------------------------------------------------------------------------

def long_names(app: AppProcess, log: Log) -> list[dict]:
    rows = []
    for folder, char, count in (("assets", "a", 300), ("static", "a", 300), ("assets", "é", 150)):
        mark = log.mark()
        answer = httpx.get(f"{app.url}/{folder}/{char * count}", timeout=60)
        rows.append({"path": f"/{folder}/<{count} x {char!r}: {len((char * count).encode())} bytes>",
                     "status": answer.status_code, "body": answer.text[:80], **written(log.since(mark))})
    return rows


# 5. previews through replicas -------------------------------------------------------------------------------------

def replica_previews(images: int) -> dict:
    with tiny_app("--replicas", "2") as app:
        client = Client(app.url, analytics_enabled=False, verbose=False)
        rows = []
        for seed in range(1, images + 1):
            job = client.submit("a lighthouse", SIZE, 40, seed, None, None, None, None, None, True,
                                api_name="/generate")
            _, info = job.result(timeout=TIMEOUT)
            steps = [out[1]["preview"]["step"] for out in job.outputs()
                     if isinstance(out[1], dict) and "preview" in out[1]]
            rows.append({"previews": len(steps), "missing_steps": sorted(set(range(2, 41)) - set(steps)),
                         "in_order": steps == sorted(steps), "cache_event": info["cache_event"],
                         "replica": info.get("replica"), "total_seconds": info["total_seconds"]})
        client.close()
    return {"steps": 40, "expected_previews": 39, "images": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=7, help="long-prompt grids sent at once (issue 46: seven)")
    parser.add_argument("--replica-images", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    started = time.monotonic()
    style = Path(tempfile.mkdtemp(prefix="round-five-")) / "ink.safetensors"  # a style, so every axis is served
    subprocess.run([sys.executable, "-m", "neuron_ui", "lora", "random", "--out", str(style)], check=True,
                   cwd=Path(__file__).resolve().parent.parent)
    with tiny_app("--mcp", "--lora", f"{style}@0.8") as app:
        log = Log(app.log)
        client = Client(app.url, analytics_enabled=False, verbose=False)
        client.predict("a warm-up", SIZE, 1, 1, api_name="/generate")  # the first image compiles the size
        results = {"labels": labels(app, client, args.burst), "line_breaks": line_breaks(app, client, log),
                   "abandoned_streams": abandoned(app, log), "long_names": long_names(app, log)}
        client.close()
    results["replica_previews"] = replica_previews(args.replica_images)
    results["passed"] = passed(results)
    results["machine"] = {"cpus": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                          "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(results, indent=1, ensure_ascii=False))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    return 0 if all(results["passed"].values()) else 1


def passed(r: dict) -> dict[str, bool]:
    """Each case against what issue 46 asks; the thresholds are generous, for a loaded 2-core machine."""
    alone, ab, burst = r["labels"]["long_prompts"], r["labels"]["ab_long_prompt"], r["labels"]["burst"]
    gone = r["abandoned_streams"]
    return {
        "labels_small_part": alone.get("answer") == "complete"
        and alone["rest_seconds"] < max(2.0, alone["cells_seconds"] / 4)
        and ab.get("answer") == "complete" and ab["request_seconds"] - ab["cells_seconds"] < 2.0,
        "second_request_answered": burst["second_request_gradio_client_generate"]["answer"] == "complete"
        and burst["queue_full"] == 0 and set(burst["answers"]) == {"complete"},
        "line_breaks_one_line": r["line_breaks"]["all_refused"] and r["line_breaks"]["all_one_line"]
        and r["line_breaks"]["traceback_lines"] == 0,
        "abandoned_stopped": all(g["stopped_requests"] >= 1 and g["next_wait_seconds"] < 5 and g["traceback_lines"] == 0
                                 for g in (gone["generate_60_steps_preview"], gone["grid_16_cells"]))
        and gone["grid_16_cells"]["images_made"] < 16,
        "long_names_404": all(row["status"] == 404 and row["traceback_lines"] == 0 for row in r["long_names"]),
        "replica_previews_all": all(row["previews"] == 39 for row in r["replica_previews"]["images"]),
    }


if __name__ == "__main__":
    sys.exit(main())
