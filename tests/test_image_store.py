"""The images a browser's history shows survive a restart (issue 22, item 2): kept in the cache folder, bounded
across restarts, served through the link in the private folder; a history entry whose file is gone is dropped.
No model, no server: the HTTP side is in test_files_kept.py."""

import errno
import logging
import os
import stat
from pathlib import Path

import pytest
from PIL import Image
from test_png import result

from neuron_ui.contract.errors import EngineError
from neuron_ui.ui.history import clean_history
from neuron_ui.web.files import IMAGE_NAME, IMAGES, ImageStore, build_image_store, private_file_folder


def image(seed: int = 7):
    made = result(Image.new("RGB", (32, 16), (seed, 0, 0)))
    made.seed = seed
    return made


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_bound_holds_across_restarts_oldest_first(tmp_path):
    folder = tmp_path / "images"
    first = ImageStore(folder, keep=3)
    made = [os.path.basename(first.save(image(seed))) for seed in range(2)]
    (folder / "notes.txt").write_text("not ours")  # a file the store did not name: neither counted nor removed
    again = ImageStore(folder, keep=3)  # a restart: the two already there count
    later = [os.path.basename(again.save(image(seed))) for seed in range(2, 4)]
    assert names(folder) == sorted([made[1], *later, "notes.txt"])  # the oldest one went, not the newest
    numbers = [int(IMAGE_NAME.fullmatch(name).group(1)) for name in [*made, *later]]
    assert numbers == sorted(numbers) and len(set(numbers)) == 4  # a restart continues the numbers
    ImageStore(folder, keep=1)  # started with a smaller bound: the files beyond it go at once
    assert names(folder) == sorted([later[1], "notes.txt"])


def test_the_bytes_kept_are_bounded_too_newest_first_and_across_restarts(tmp_path):
    """Issue 45: 512 files of a bounded count were up to 6.4 GB at 2048x2048, and more as grid sheets; the store also
    keeps at most `keep_bytes`, the oldest going first, the newest always kept."""
    folder = tmp_path / "images"
    probe = ImageStore(tmp_path / "probe")
    size = (probe.folder / os.path.basename(probe.save(image()))).stat().st_size  # every image() is this size
    store = ImageStore(folder, keep=10, keep_bytes=int(2.5 * size))
    made = [os.path.basename(store.save(image(seed))) for seed in range(5)]
    assert names(folder) == sorted(made[-2:])  # 2 files fit in 2.5 files' bytes; the count bound (10) is far
    ImageStore(folder, keep=10, keep_bytes=size)  # a restart with a smaller byte bound: the older one goes at once
    assert names(folder) == [made[-1]]
    tiny = ImageStore(folder, keep=10, keep_bytes=1)  # not even one file fits: the newest is still kept
    assert names(folder) == [made[-1]]
    newest = os.path.basename(tiny.save(image(9)))
    assert names(folder) == [newest] and sum(p.stat().st_size for p in folder.iterdir()) == size


def test_the_store_in_the_cache_folder_is_0700_and_served_through_the_private_folders_link(tmp_path):
    store = build_image_store(tmp_path / "cache", keep=5)
    assert store.folder == (tmp_path / "cache" / IMAGES).resolve()
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    assert store.served.parent == private_file_folder() and store.served.resolve() == store.folder
    assert store.served.name.startswith(f"{IMAGES}-") and str(tmp_path) not in store.served.name
    path = store.save(image())
    assert os.path.dirname(path) == str(store.served) and (store.folder / os.path.basename(path)).is_file()
    assert IMAGE_NAME.fullmatch(os.path.basename(path))
    assert build_image_store(tmp_path / "cache").served == store.served  # the same cache folder: the same link
    other = build_image_store(tmp_path / "other")  # another cache folder served by this process: its own link
    assert other.served != store.served and other.served.resolve() == (tmp_path / "other" / IMAGES).resolve()


def test_a_cache_folder_that_cannot_hold_images_gets_a_private_folder_and_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        store = build_image_store(blocker)
    assert store.folder.parent == private_file_folder() and store.folder.name.startswith("images-")
    assert len([r for r in caplog.records if "cannot keep images" in r.message]) == 1
    assert os.path.isfile(store.save(image()))


class ShortOfRoom:
    """A file on a full disk: its first write lands, the next fails with ENOSPC."""

    def __init__(self, file):
        self.file, self.writes = file, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)


def full_disk(folder, monkeypatch):
    """No file can be written whole into `folder` (ENOSPC after its first bytes), elsewhere as usual: the disk is
    what is patched (pathlib's open), not the code that writes."""
    real_open = Path.open

    def opened(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return ShortOfRoom(file) if "w" in mode and path.parent == folder else file

    monkeypatch.setattr(Path, "open", opened)


def test_a_full_disk_is_one_line_and_leaves_no_half_file(tmp_path, monkeypatch):
    store = ImageStore(tmp_path / "images")
    made = image()
    full_disk(store.folder, monkeypatch)
    with pytest.raises(EngineError, match="^the image was made but the server's disk is full") as error:
        store.save(made)
    assert "\n" not in str(error.value) and str(tmp_path) not in str(error.value)
    assert names(store.folder) == []


def test_a_full_cache_disk_keeps_images_in_the_private_folder_until_there_is_room(tmp_path, monkeypatch, caplog):
    store = build_image_store(tmp_path / "cache", keep=2)
    made = image()
    full_disk(store.folder, monkeypatch)
    with caplog.at_level(logging.WARNING):
        spilled = [store.save(made) for _ in range(3)]
    assert len([r for r in caplog.records if "no room for images" in r.message]) == 1
    assert names(store.folder) == [] and all(Path(p).parent.parent == private_file_folder() for p in spilled)
    assert [Path(p).is_file() for p in spilled] == [False, True, True]  # bounded there too
    monkeypatch.undo()  # room again: back in the cache folder, the bound over both
    kept = store.save(image())
    assert Path(kept).parent == store.served and [Path(p).is_file() for p in spilled] == [False, False, True]


def test_a_restored_history_keeps_entries_whose_images_are_there_and_drops_the_rest(tmp_path):
    """Paths as the browser keeps them: relative to the private folder (the gate cut its prefix)."""
    private = tmp_path / "private"
    private.mkdir()
    store = ImageStore(tmp_path / "cache" / IMAGES, keep=2, served=private / "images-0123456789abcdef")
    store.served.symlink_to(store.folder)
    (private / ("a" * 64)).mkdir()
    upload = private / ("a" * 64) / "ref.png"
    upload.write_bytes(b"x")
    kept, pruned = (os.path.relpath(store.save(image(seed)), private) for seed in (1, 2))
    os.unlink(store.folder / os.path.basename(pruned))  # gone, as the store's bound removes it
    (store.folder.parent / "session-secret").write_text("k" * 40)
    history = [{"path": kept, "seed": 1, "resolution": "32x16", "references": [kept, "a" * 64 + "/ref.png", "gone.png"],
                "editor": {"background": kept, "layers": []}},
               {"path": pruned, "seed": 2, "resolution": "32x16"},
               {"path": "images-3f2a/00001-0123abcd-32x16-seed1.png", "seed": 3, "resolution": "32x16"},  # old folder
               {"path": f"{store.served.name}/../session-secret", "seed": 4, "resolution": "32x16"},
               {"path": str(store.folder / os.path.basename(kept)), "seed": 5, "resolution": "32x16"},  # the target
               {"path": str(upload), "seed": 6, "resolution": "32x16"}]  # an upload is not a result
    cleaned = clean_history(history, store.folder, private, 10)
    assert [entry.seed for entry in cleaned] == [1]
    entry = cleaned[0]
    assert entry.path == str(private / kept)  # named under the private folder, not the link's target
    assert entry.references == (str(private / kept), str(upload))
    assert entry.editor is not None and entry.editor.background == str(private / kept)


def test_a_grid_a_page_still_shows_outlives_newer_images_and_compare_says_when_one_expired(tmp_path):
    """Issue 46, defect 7: an 8-cell grid's images were gone from a page's history 47 minutes on (the store keeps a
    count, and newer images pushed them out), and Compare said "only one image". A page that loads or saves its
    history marks its images as shown, so the bound drops what no page showed for longest; an image it dropped all
    the same is said to have expired, in one line."""
    import gradio as gr

    from neuron_ui.ui import compare
    from neuron_ui.ui.history import HistoryEntry
    from neuron_ui.ui.session import HeldResults, SessionEvents

    store = ImageStore(tmp_path / "images", keep=10)
    cells = [HistoryEntry(store.save(image(seed)), "", "a fox", "32x16", seed) for seed in range(8)]
    history = cells[::-1]
    events = SessionEvents(None, store, HeldResults(), uploads=tmp_path)  # the engine is not asked here
    for seed in range(8, 12):  # other visitors' images, while the page is open
        store.save(image(seed))
        events.on_save({"id": "a" * 22}, "a fox", "32x16", 4, 0, True, 1.0, history)  # the page saves its form
    assert all(Path(e.path).is_file() for e in history)  # before: the oldest two cells were gone
    for seed in range(12, 22):  # a page that saves nothing: its images go, oldest first
        store.save(image(seed))
    assert not any(Path(e.path).is_file() for e in history)
    with pytest.warns(UserWarning, match=r"^The other images of this history have expired on the server"):
        assert compare.on_ab_open(history[0].path, history)[0] == gr.skip()
    shown = HistoryEntry(store.save(image(22)), "", "a fox", "32x16", 22)
    with pytest.warns(UserWarning, match="expired"):
        assert compare.on_ab_pick(shown.path, [shown, *history], gr.SelectData(None, {"index": 2, "value": None})) == \
            (gr.skip(), gr.skip())


def test_a_page_whose_state_gradio_dropped_saves_its_new_image_beside_the_browsers_history(tmp_path):
    """Issue 46, defect 7, a second cause: Gradio keeps page state for at most 500 sessions, so a page idle past
    that many newer ones starts its in-page history over, and the next image made its history [new]; saving that
    overwrote the browser's copy, and the older entries were lost though their files were on disk. The browser's
    copy is merged in, newest first, bounded as before."""
    from neuron_ui.ui.history import HistoryEntry
    from neuron_ui.ui.session import HISTORY_SIZE, HeldResults, SessionEvents

    store = ImageStore(tmp_path / "images", keep=64)
    entries = [HistoryEntry(store.save(image(seed)), "", "a fox", "32x16", seed, made=float(seed))
               for seed in range(HISTORY_SIZE + 1)]
    older, new = entries[:-1], entries[-1]
    events = SessionEvents(None, store, HeldResults(), uploads=tmp_path)  # the engine is not asked here
    # the browser's copy: 24 entries, newest first
    stored = {"id": "a" * 22, "history": [e.to_json() for e in older[::-1]]}
    saved = events.on_save(stored, "a fox", "32x16", 4, 0, True, 1.0, [new])  # the page's history: [new]
    assert [e["seed"] for e in saved["history"]] == list(range(HISTORY_SIZE, 0, -1))  # bounded: the oldest goes
    again = events.on_save(saved, "a cat", "32x16", 4, 0, True, 1.0, [new])
    assert again["history"] == saved["history"]  # saving again changes nothing
