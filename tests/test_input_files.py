"""Input files without a server: the one rule for the files a request may name, reading only regular files, decoding
within the memory budget, and the upload folder's budget and retention. Fast: no model, no server."""

import io
import os
import threading
import time
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.images import decode as images
from neuron_ui.contract import references as refs
from neuron_ui.contract.files import ForeignFile, StoredFiles
from neuron_ui.web.uploads import FILE_COST, UploadFolder


def png(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=save.pop("format", "PNG"), **save)
    return out.getvalue()


# -- the rule: only the app's own files, decided before anything is read ---------------------------------------


def test_only_paths_inside_the_folder_are_files_of_the_app(tmp_path):
    stored = StoredFiles(tmp_path)
    (tmp_path / "abc").mkdir()
    assert stored.resolve(str(tmp_path / "abc" / "x.png")) == str(tmp_path / "abc" / "x.png")
    assert stored.resolve("abc/x.png") == str(tmp_path / "abc" / "x.png")  # relative: inside the folder
    for path in ("/etc/passwd", "../../etc/passwd", "abc/../../x.png", str(tmp_path), "", "a\x00b", 12, None,
                 ["/etc/passwd"], {"path": "x"}, str(tmp_path) + "-other/x.png"):
        with pytest.raises(ForeignFile, match="is not a file of this app: upload it first"):
            stored.resolve(path)


def test_a_refusal_says_nothing_about_what_exists(tmp_path):
    """The same line for a file that exists, one that does not and one nobody may read: no existence oracle."""
    stored = StoredFiles(tmp_path / "app")
    lines = set()
    for path in ("/etc/passwd", "/etc/shadow", "/nonexistent/photo.png"):
        with pytest.raises(ForeignFile) as caught:
            stored.resolve(path)
        lines.add(str(caught.value).replace(repr(path), "<path>"))
    assert len(lines) == 1


def test_use_restarts_an_uploads_retention_clock(tmp_path):
    upload = tmp_path / "f" / "a.png"
    upload.parent.mkdir()
    upload.write_bytes(b"x")
    os.utime(upload, (1, 1))
    StoredFiles(tmp_path).use(str(upload))
    assert time.time() - upload.stat().st_mtime < 60


# -- reading: regular files only, the size counted while reading --------------------------------------------------


def test_a_fifo_is_refused_at_once_unread(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    done = []
    worker = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, refs.fit_reference, str(fifo),
                                                                         parse_resolution("256x256"))),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert done, "reading a FIFO held the request"
    assert "reference is not a regular file" in str(done[0].value)


def test_a_device_is_refused_unread():
    with pytest.raises(ValueError, match="reference is not a regular file"):
        refs.fit_reference("/dev/zero", parse_resolution("256x256"))


# -- decoding: within the budget, no wide copies -------------------------------------------------------------------


def test_at_most_two_images_are_decoded_at_once():
    """Six images at once, from six threads: they are decoded two at a time. Each decode (decoded() copies an
    in-memory image) is counted and held until the test has seen two in and no third get in."""
    active, most = [0], [0]
    changed, release = threading.Condition(), threading.Event()

    class Held(Image.Image):
        def copy(self):
            with changed:
                active[0] += 1
                most[0] = max(most[0], active[0])
                changed.notify_all()
            release.wait(30)
            try:
                return super().copy()
            finally:
                with changed:
                    active[0] -= 1
                    changed.notify_all()

    def held() -> Image.Image:
        image = Image.new("RGB", (64, 64), (10, 20, 30))
        image.__class__ = Held  # this test's own image: its decode is the counted copy
        return image

    workers = [threading.Thread(target=refs.fit_reference, args=(held(), parse_resolution("256x256")))
               for _ in range(6)]
    for worker in workers:
        worker.start()
    with changed:
        assert changed.wait_for(lambda: active[0] == images.DECODERS, 30)  # two decode now...
        assert not changed.wait_for(lambda: active[0] > images.DECODERS, 0.5)  # ... and no third gets in
    release.set()
    for worker in workers:
        worker.join(30)
    assert most[0] == images.DECODERS == 2


def test_a_sixteen_bit_image_is_reduced_without_wide_copies():
    """16 MP of 16-bit grey: numpy's own allocations stay a few MB (a float64 copy alone was 128 MB)."""
    source = Image.fromarray(np.tile(np.arange(0, 65536, 16, dtype=np.uint16), (4000, 1))[:, :4000])
    tracemalloc.start()
    try:
        reduced = images.to_8bit(source, "reference", [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reduced.mode == "L" and peak < 32 * 2**20, peak
    expected = np.floor(np.asarray(source)[0].astype(np.float64) * 255 / 65535 + 0.5)
    assert (np.asarray(reduced)[0] == expected).all()  # rounded as before, when it went through float64


def test_a_32_bit_integer_tiff_is_said_to_be_32_bit():
    tiff = png(Image.fromarray(np.full((60, 80), 70000, np.int32), "I"), format="TIFF")
    fitted = refs.fit_reference(tiff, parse_resolution("256x256"))
    assert any("32-bit integer image reduced to 8 bits" in n for n in fitted.notes), fitted.notes
    assert not any("16-bit" in n for n in fitted.notes)
    sixteen = refs.fit_reference(png(Image.fromarray(np.full((60, 80), 65535, np.uint16))), parse_resolution("256x256"))
    assert any("16-bit image reduced to 8 bits" in n for n in sixteen.notes), sixteen.notes


# -- the upload folder: a budget, and retention ------------------------------------------------------------------


def upload(root, name: int, size: int, mtime: float | None = None):
    folder = root / f"{name:064x}"  # Gradio's <sha256>/ folder
    folder.mkdir()
    path = folder / "a.png"
    path.write_bytes(b"x" * size)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_uploads_past_the_budget_are_refused_until_retention_frees_room(tmp_path):
    now = [1000.0]
    folder = UploadFolder(tmp_path, budget=100_000, retention=60, clock=lambda: now[0])
    assert folder.admit(None).status == 411
    assert folder.admit(100_001).status == 413
    assert folder.admit(60_000) is None
    old = upload(tmp_path, 1, 60_000, mtime=now[0])
    folder.done(60_000, 1)
    refused = folder.admit(60_000)
    assert refused.status == 507 and "\n" not in refused.message and "try again in a few minutes" in refused.message
    now[0] += 61  # a minute unused: the next admission sweeps it away
    assert folder.admit(60_000) is None and not old.exists() and not old.parent.exists()


def test_many_tiny_files_count_what_they_take_on_disk(tmp_path):
    folder = UploadFolder(tmp_path, budget=20 * FILE_COST, retention=60)
    for name in range(20):
        upload(tmp_path, name, 1)
    (tmp_path / "images-x").mkdir()  # the results' folder is not the uploads'
    (tmp_path / "images-x" / "big.png").write_bytes(b"x" * 10 * FILE_COST)
    folder.sweep()
    assert folder.used == 20 * FILE_COST and folder.admit(1).status == 507

