"""Results kept across a restart, over raw HTTP (issue 22, item 2): the address a browser's history holds serves the
same image from the next process on the same cache folder, and the file route serves nothing else: not the cache
folder's other files, not another cache folder's images, not a link or a stray file among the images."""

import http.client
from urllib.parse import quote, urlparse

import pytest
from serving import TIMEOUT, call, connect, served

from neuron_ui.config.session_secret import SECRET_FILE
from neuron_ui.web.files import IMAGES
from neuron_ui.web.gradio_bridge import serve_in_place

GENERATE = ("a lighthouse", "256x256", 1, 5)


def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written ('..' and all: httpx would fold it before sending)."""
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=TIMEOUT)
    try:
        connection.request("GET", path)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """An image made by one server, then a second server on the same cache folder (a restart): (served, image).
    Neither compiles (`--compile eager`): what is kept here is the image store, not the compile cache."""
    root = tmp_path_factory.mktemp("kept")
    with served(root / "cache", "--compile", "eager") as first:
        client = connect(first.url, root, download_files=False)
        image, _ = call(client, *GENERATE)
        client.close()
        status, before = raw_get(first.url, "/gradio_api/file=" + image["path"])
        assert status == 200 and before.startswith(b"\x89PNG")
    with served(root / "cache", "--compile", "eager") as again:
        yield again, image, before


def test_the_address_a_history_holds_serves_the_same_image_after_a_restart(kept):
    s, image, before = kept
    assert not image["path"].startswith("/") and image["path"].split("/")[0].startswith(f"{IMAGES}-")
    assert raw_get(s.url, "/gradio_api/file=" + image["path"]) == (200, before)
    assert raw_get(s.url, "/gradio_api/file/" + image["path"]) == (200, before)  # the older spelling of the route
    store = s.handlers().store
    assert store.folder == (s.settings.cache_dir / IMAGES).resolve() and len(list(store.folder.iterdir())) == 1


def test_the_file_route_serves_none_of_the_cache_folders_other_files(kept, tmp_path):
    s, image, _ = kept
    cache, store = s.settings.cache_dir.resolve(), s.handlers().store
    link = image["path"].split("/")[0]
    (store.folder / "notes.png").write_bytes(b"\x89PNG not ours")  # a stray file among the images
    planted = store.folder / "00999-0123abcd-256x256-seed1.png"  # named like ours, a link to the session key
    planted.symlink_to(cache / SECRET_FILE)
    other = tmp_path / "other-cache" / IMAGES  # another cache folder's images, which Gradio serves in this process
    other.mkdir(parents=True)
    (other / "00001-0123abcd-256x256-seed1.png").write_bytes(b"\x89PNG another's")
    serve_in_place(other)
    try:
        compiled = cache / "inductor" / "graph.bin"  # the compile cache (nothing is compiled into it here)
        compiled.write_bytes(b"compiled bytes")
        secrets = ((cache / SECRET_FILE).read_bytes().strip(), b"compiled bytes", b"PNG")
        targets = [f"{link}/../{SECRET_FILE}", f"{link}/../../{SECRET_FILE}", f"{link}/..", link, f"{link}/notes.png",
                   f"{link}/{planted.name}", f"{link}/../../{cache.name}/{SECRET_FILE}", str(cache / SECRET_FILE),
                   str(compiled), str(store.folder / image["path"].split("/")[1]),  # ours, but not by its address
                   str(other / "00001-0123abcd-256x256-seed1.png"), "/etc/passwd"]
        for route in ("/gradio_api/file=", "/gradio_api/file/"):
            for target in targets:
                for spelled in (target, quote(target)):
                    status, body = raw_get(s.url, route + spelled)
                    assert status in (403, 404), (route, spelled, status)
                    assert not any(secret in body for secret in secrets), (route, spelled)
    finally:
        planted.unlink()
        compiled.unlink()
        (store.folder / "notes.png").unlink()
    assert raw_get(s.url, "/gradio_api/file=" + image["path"])[0] == 200  # ours, still served
