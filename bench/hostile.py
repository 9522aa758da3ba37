"""What hostile requests cost a running app (issue 21): memory it holds after Gradio's component server calls, and
what it logs for deeply nested JSON. Runs `python app.py` on the tiny model and measures it from outside; about a
minute on 2 cores.

    python bench/hostile.py --out bench/results/hostile.json

Memory is the app process's resident set (VmRSS); log is what the app wrote to stderr while the requests were
answered (its log, as app.py configures it, and uvicorn's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is a folder of scripts, not a package

from app_process import tiny_app  # noqa: E402


DEEP_ROUTES = ("/gradio_api/call/generate", "/gradio_api/queue/join", "/gradio_api/run/predict", "/gradio_api/cancel")


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) // 1024


def component_server(url: str, pid: int, posts: int, blob_mb: int) -> dict:
    """`posts` blobs of `blob_mb` MB to the image editor's accept_blobs, then one with a layer index of 10^8."""
    config = httpx.get(url + "/config", timeout=60).json()
    editor = next(c["id"] for c in config["components"] if c["type"] == "imageeditor")
    blob = b"\x89PNG" + b"x" * (blob_mb << 20)

    def post(i: int, kind: str, index: str, data: bytes) -> int:
        fields = {"component_id": str(editor), "session_hash": f"s{i}", "fn_name": "accept_blobs", "id": f"b{i}",
                  "type": kind, "index": index}
        files = {"file": ("blob.png", data, "image/png")}
        return httpx.post(url + "/gradio_api/component_server", data=fields, files=files, timeout=120).status_code

    idle = rss_mb(pid)
    statuses = {post(i, "background", "null", blob) for i in range(posts)}
    time.sleep(1)
    after_posts = rss_mb(pid)
    statuses.add(post(posts, "layer", "100000000", b"x"))
    time.sleep(1)
    return {"posts": posts, "blob_mb": blob_mb, "statuses": sorted(statuses), "rss_idle_mb": idle,
            "rss_after_posts_mb": after_posts, "rss_after_index_1e8_mb": rss_mb(pid)}


def deep_json(url: str, log: Path, depth: int) -> dict:
    """One request nested `depth` levels to each of DEEP_ROUTES: the answers, and the app's stderr meanwhile."""
    body = '{"data": %s, "fn_index": 0, "session_hash": "x", "event_id": "x"}' % ("[" * depth + "]" * depth)
    before = log.stat().st_size
    answers = [httpx.post(url + route, content=body, headers={"content-type": "application/json"}, timeout=120)
               for route in DEEP_ROUTES]
    time.sleep(1)
    with log.open("rb") as f:
        f.seek(before)
        written = f.read()
    return {"depth": depth, "request_bytes": len(body), "requests": len(DEEP_ROUTES),
            "statuses": [f"{a.status_code} {a.headers.get('content-type', '')}" for a in answers],
            "log_bytes": len(written), "log_lines": written.count(b"\n")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posts", type=int, default=40)
    parser.add_argument("--blob-mb", type=int, default=24)
    parser.add_argument("--depth", type=int, default=20_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tiny_app() as app:
        results = {"component_server": component_server(app.url, app.pid, args.posts, args.blob_mb),
                   "deep_json": deep_json(app.url, app.log, args.depth)}
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
