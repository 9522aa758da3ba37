"""Editing by raw HTTP (httpx), as a script or an attacker sends it: uploads, /generate with references, /inpaint,
and files the caller names but never uploaded (the API takes file values as sent, so the gate must refuse them)."""

import io
import json
import re

import httpx
import pytest
from PIL import Image
from serving import TIMEOUT, served

GIT_LOGO = "/usr/share/gitweb/static/git-logo.png"  # any image on the server's disk that nobody uploaded


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    with served(tmp_path_factory.mktemp("http-editing") / "cache") as s:
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
    event, (image, info) = run(s, "generate", ["a fox", "256x256", 1, 1, None, [upload(s, png())], "512x512", None, None])
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
