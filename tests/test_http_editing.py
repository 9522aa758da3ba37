"""Editing by raw HTTP (httpx), as a script or an attacker sends it: uploads, /generate with references, /inpaint,
and files the caller names but never uploaded (the API takes file values as sent, so the gate must refuse them)."""

import io
import json
import os
import re
import struct
import zlib

import httpx
import pytest
from PIL import Image
from serving import TIMEOUT, served

GIT_LOGO = "/usr/share/gitweb/static/git-logo.png"  # any image on the server's disk that nobody uploaded


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    with served(tmp_path_factory.mktemp("http-editing") / "cache", "--compile", "eager") as s:  # none read here
        yield s


def png(size=(300, 200), color=(20, 120, 200), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else 255).save(out, format="PNG")
    return out.getvalue()


def upload(s, data: bytes, name="in.png") -> dict:
    response = httpx.post(s.url + "/gradio_api/upload", files={"files": (name, data)}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    (path,) = response.json()
    assert not path.startswith("/"), path  # the server's folder is never sent out
    return {"path": path, "meta": {"_type": "gradio.FileData"}}


def run(s, name: str, data: list) -> tuple[str, object]:
    """POST /gradio_api/call/<name>, then read its event stream to the end: (last event, its data)."""
    started = httpx.post(s.url + f"/gradio_api/call/{name}", json={"data": data}, timeout=TIMEOUT)
    assert started.status_code == 200, started.text
    stream = httpx.get(s.url + f"/gradio_api/call/{name}/{started.json()['event_id']}", timeout=TIMEOUT).text
    event, payload = re.findall(r"event: (\w+)\ndata: (.*)\n", stream)[-1]
    return event, json.loads(payload)


def test_generate_with_an_uploaded_reference(s):
    references = [upload(s, png())]
    event, (image, info) = run(s, "generate", ["a fox", "256x256", 1, 1, None, references, "512x512", None, None])
    assert event == "complete", info
    assert info["tokens"] == 256 + 1024 and info["inputs"][0]["fitted_size"] == "512x512"
    assert info["inputs"][0]["source_size"] == "300x200"
    assert httpx.get(image["url"], timeout=TIMEOUT).content.startswith(b"\x89PNG")


def test_inpaint_with_an_uploaded_image_and_mask(s):
    mask = png((300, 200), mode="L")  # painted on the image itself: its size
    event, payload = run(s, "inpaint", [upload(s, png()), upload(s, mask), "a door", 0.5, "256x256", 2, 3, None,
                                     None, None, None])
    assert event == "complete", payload
    _, info = payload
    assert (info["mode"], info["strength"], info["tokens"]) == ("inpaint", 0.5, 2 * 256)
    assert [i["role"] for i in info["inputs"]] == ["image", "mask"]
    event, payload = run(s, "inpaint", [upload(s, png()), upload(s, png((256, 256), mode="L")), "a door", 0.5,
                                        "256x256", 2, 3, None, None, None, None])
    assert event == "error" and "paint the mask on the image itself" in payload["error"], payload


@pytest.mark.parametrize("path", [GIT_LOGO, "/etc/passwd", "../../../../usr/share/gitweb/static/git-logo.png"])
def test_a_file_that_was_never_uploaded_is_refused_before_it_is_read(s, path):
    named = {"path": path, "meta": {"_type": "gradio.FileData"}}
    for name, data in (("generate", ["a fox", "256x256", 1, 1, None, [named], None, None, None]),
                       ("inpaint", [named, named, "a door", 0.5, "256x256", 1, 1, None, None, None, None])):
        response = httpx.post(s.url + f"/gradio_api/call/{name}", json={"data": data}, timeout=TIMEOUT)
        assert response.status_code == 403, response.text
        assert "is not a file of this app: upload it first" in response.json()["detail"]
    generate = next(fn._id for fn in s.demo.fns.values() if fn.api_name == "generate")
    joined = httpx.post(s.url + "/gradio_api/queue/join", timeout=TIMEOUT,
                        json={"data": ["a fox", "256x256", 1, 1, None, [named], None, None, None], "fn_index": generate,
                              "session_hash": "attacker"})
    assert joined.status_code == 403, joined.text


def test_bad_uploads_get_one_line_each(s):
    cases = {
        "not an image": (["a fox", "256x256", 1, 1, None, [upload(s, b"plain text", "notes.png")], None, None, None],
                          "generate"),
        "a truncated image": (["a fox", "256x256", 1, 1, None, [upload(s, png()[:80], "cut.png")], None, None, None],
                              "generate"),
        "inpaint without a mask": ([upload(s, png()), None, "a door", 0.5, "256x256", 1, 1, *[None] * 4], "inpaint"),
        "too many references": (["a fox", "256x256", 1, 1, None, [upload(s, png()) for _ in range(3)], None, None,
                                 None],
                                "generate"),
    }
    for case, (data, name) in cases.items():
        event, payload = run(s, name, data)
        assert event == "error", (case, payload)
        message = payload["error"]
        assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message, case


# -- every shape of file value, on every route: only the app's own files, refused before any read ---------------


def png_header(width: int, height: int) -> bytes:
    """A PNG that says it is width x height (1-bit grey) and holds no pixels: what a bomb's header says."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def fn_index(s, name: str) -> int:
    return next(f._id for f in s.demo.fns.values() if f.api_name == name or getattr(f.fn, "__name__", "") == name)


def join(s, name: str, data: list, session: str) -> dict:
    """POST /gradio_api/queue/join as the browser does, then its event stream to the end: the last message."""
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        joined = http.post("/gradio_api/queue/join", json={"data": data, "fn_index": fn_index(s, name),
                                                            "session_hash": session, "event_data": None,
                                                            "trigger_id": None})
        assert joined.status_code == 200, joined.text
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                message = json.loads(line[5:]) if line.startswith("data:") else {}
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError("the event stream ended without a result")


def editor_call(editor) -> list:
    """on_inpaint's inputs: editor (the hidden one the page hands the visible editor's uploaded value to), prompt,
    resolution, strength, steps, seed, randomize, guidance, references, reference size, fit, history, session."""
    return [editor, "a door", "256x256", 0.5, 2, 3, False, 1.0, None, "512x512", "crop", [], {}]


@pytest.fixture
def fifo(tmp_path):
    """A FIFO outside the app's folder: reading it would hold the request until the test's timeout."""
    path = tmp_path / "held.png"
    os.mkfifo(path)
    return str(path)


def test_no_shape_of_file_value_reads_a_file_the_app_did_not_store(s, fifo):
    shapes = [{"path": fifo}, fifo, [fifo], {"path": fifo, "meta": {"_type": "gradio.FileData"}},
              {"path": fifo, "url": None, "orig_name": "x.png"}, {"path": "/etc/passwd"}, "../../../../etc/passwd"]
    mask = upload(s, png((300, 200), mode="L"))
    quick = {"timeout": 10}  # a read of the FIFO would wait for a writer that never comes
    for shape in shapes:
        calls = [
            ("/gradio_api/call/inpaint", {"data": [shape, mask, "a door", 0.5, "256x256", 1, 1, None, None]}),
            ("/gradio_api/call/inpaint", {"data": [upload(s, png()), shape, "a door", 0.5, "256x256", 1, 1, None,
                                                   None]}),
            ("/gradio_api/call/generate", {"data": ["a fox", "256x256", 1, 1, None, [shape], None]}),
            ("/gradio_api/call/generate", {"data": ["a fox", "256x256", 1, 1, None, shape, None]}),
            ("/gradio_api/call/v2/inpaint", {"image": shape, "mask": mask, "prompt": "a door"}),
            ("/gradio_api/call/v2/generate", {"prompt": "a fox", "resolution": "256x256", "references": [shape]}),
            ("/gradio_api/queue/join", {"data": editor_call({"background": shape, "layers": []}),
                                        "fn_index": fn_index(s, "on_inpaint"), "session_hash": "attacker"}),
            ("/gradio_api/queue/join", {"data": editor_call({"background": upload(s, png()), "layers": [shape]}),
                                        "fn_index": fn_index(s, "on_inpaint"), "session_hash": "attacker"}),
            ("/gradio_api/run/predict", {"data": [[shape], "512x512", "crop"], "fn_index": fn_index(s, "on_preview"),
                                         "session_hash": "attacker"}),
        ]
        for route, body in calls:
            response = httpx.post(s.url + route, json=body, **quick)
            assert response.status_code == 403, (route, shape, response.text)
            assert "is not a file of this app: upload it first" in response.json()["detail"], (route, shape)


def test_a_fifo_in_the_apps_folder_is_refused_unread(s):
    """Not a regular file: refused in one line without waiting for a writer (stat() says 0 bytes for it)."""
    folder = s.server.stored.root / ("f" * 64)
    folder.mkdir(exist_ok=True)
    os.mkfifo(folder / "pipe.png")
    named = {"path": str(folder / "pipe.png"), "meta": {"_type": "gradio.FileData"}}
    event, payload = run(s, "inpaint", [named, named, "a door", 0.5, "256x256", 1, 1, None, None])
    assert event == "error" and payload["error"] == "image is not a regular file: upload an image file", payload


def test_the_inpaint_editor_gets_the_upload_checks_and_one_line_each(s, capfd):
    background = upload(s, png())
    layer = upload(s, png((300, 200), mode="RGBA"))
    svg = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'
    cases = {
        "painted layer 1 is 12000x12000 pixels; the limit is 40 megapixels":
            {"background": background, "layers": [upload(s, png_header(12000, 12000))]},
        "image is too many pixels; the limit is 40 megapixels":
            {"background": upload(s, png_header(30000, 30000)), "layers": [layer]},
        "image is not an image (PNG, JPEG, WebP, GIF...)":
            {"background": upload(s, b"plain text", "notes.png"), "layers": [layer]},
        "image is truncated or damaged: it cannot be decoded":
            {"background": upload(s, png()[:80], "cut.png"), "layers": [layer]},
        "image is an SVG drawing, which is not read here: export it as PNG":
            {"background": upload(s, svg, "drawing.svg"), "layers": [layer]},
        "image is a PDF document, not an image: export the page as PNG or JPEG":
            {"background": upload(s, b"%PDF-1.7\n%\xe2\xe3\n1 0 obj", "page.pdf"), "layers": [layer]},
        "image is an empty file (0 bytes): upload the image again":
            {"background": upload(s, b"", "empty.png"), "layers": [layer]},
    }
    capfd.readouterr()
    for number, (line, editor) in enumerate(cases.items()):
        message = join(s, "on_inpaint", editor_call(editor), f"editor-{number}")
        assert message["success"] is False and message["output"]["error"] == line, (line, message)
    jpeg = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 100, 50)).save(jpeg, format="JPEG")
    painted = Image.new("RGBA", (300, 200), (0, 0, 0, 0))
    painted.paste((255, 0, 255, 255), (0, 0, 150, 100))
    made = join(s, "on_inpaint", editor_call({"background": upload(s, jpeg.getvalue(), "photo.jpg"),
                                              "layers": [upload(s, png_of(painted))]}), "editor-jpeg")
    assert made["success"] is True, made
    assert "inpaint, strength 0.5" in made["output"]["data"][1]
    assert "Traceback" not in capfd.readouterr().err


def png_of(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()

