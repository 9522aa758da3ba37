"""A disk that fills after start-up: each compile checks for room, falls back to a temporary folder on a full
disk (before, or on ENOSPC during, the compile), says "not persistent: disk full" everywhere, and goes back to
the persistent folder once there is room again."""

import errno
import logging
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from runners import local_engine
import torch
from serving import served
from torch._inductor.runtime.cache_dir_utils import cache_dir

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.strategies import CompileFolder
from neuron_ui.config.cache_paths import configure_cache_env, free_bytes, is_disk_full
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.tiny import build_tiny_pipeline

MiB = 2**20
FULL = "not persistent: disk full"


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder set up as app.py does, in os.environ (restored after), so torch's cache_dir() sees it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "cache" / "neff"))
    return configure_cache_env(tmp_path / "cache")


def test_torch_reads_the_inductor_folder_each_time_it_writes(cache, tmp_path, monkeypatch):
    assert cache_dir() == str(cache.inductor)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == str(tmp_path / "elsewhere")  # no memo: moving one compile is an env var away


def test_a_compile_that_finds_too_little_room_runs_in_a_temporary_folder_until_there_is_room(cache, caplog):
    free = {"bytes": 10 * MiB}
    folder = CompileFolder(cache, free=lambda path: free["bytes"])

    where = folder.run(cache_dir)

    assert not Path(where).is_relative_to(cache.root) and Path(where).is_dir()
    assert not folder.persistent and folder.problem.startswith(FULL) and "10 MiB free" in folder.problem
    assert FULL in caplog.text
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.inductor)  # only for that compile

    free["bytes"] = 10_000 * MiB
    assert folder.run(cache_dir) == str(cache.inductor)
    assert folder.persistent and folder.problem is None
    assert "persistent again" in caplog.text


def test_enospc_during_a_compile_runs_it_again_in_a_temporary_folder(cache):
    folders = []

    def compile_into_a_full_disk():
        folders.append(cache_dir())
        if Path(cache_dir()).is_relative_to(cache.root):
            try:
                raise no_space()
            except OSError as error:  # as dynamo reports it: the compiler's error, wrapped
                raise RuntimeError("backend compiler failed") from error
        return "compiled"

    folder = CompileFolder(cache, free=lambda path: 10_000 * MiB)

    assert folder.run(compile_into_a_full_disk) == "compiled"
    assert folders[0] == str(cache.inductor) and not Path(folders[1]).is_relative_to(cache.root)
    assert folder.problem.startswith(FULL)


def test_other_compile_errors_are_not_taken_for_a_full_disk(cache):
    folder = CompileFolder(cache, free=lambda path: 10_000 * MiB)

    def broken():
        raise RuntimeError("a compiler bug")

    with pytest.raises(RuntimeError, match="a compiler bug"):
        folder.run(broken)
    assert folder.persistent
    assert is_disk_full(RuntimeError("x")) is False
    assert is_disk_full(OSError(errno.EDQUOT, "quota")) is True


# -- the engine and the app, on a disk that really fills ----------------------------------------------------


class Disk:
    """A 96 MiB tmpfs that fill() fills until ENOSPC; where this process may not mount, a simulated one."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir()
        self.real = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(folder)],
                                   capture_output=True, check=False).returncode == 0
        if not self.real:
            logging.getLogger(__name__).warning("no tmpfs here: a full disk is simulated with an injected ENOSPC")
        self.full = False

    def fill(self) -> None:
        self.full = True
        if self.real:
            # Unbuffered: a buffered file keeps the bytes a short write left, and its close() raised ENOSPC again.
            with open(self.folder / "filler", "wb", buffering=0) as handle:
                try:
                    while True:
                        handle.write(b"\0" * MiB)
                except OSError as error:
                    assert error.errno == errno.ENOSPC

    def free_up(self) -> None:
        self.full = False
        (self.folder / "filler").unlink(missing_ok=True)

    def free_bytes(self, path: Path) -> int:
        if self.real:
            return free_bytes(path)
        return 0 if self.full else 10_000 * MiB

    def write(self, path: Path, data: bytes) -> None:
        """Write then rename, as inductor does: a write cut short by ENOSPC leaves nothing."""
        if not self.real and self.full and path.is_relative_to(self.folder):
            raise no_space()
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(data)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.rename(path)

    def unmount(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.folder)], check=False)


@pytest.fixture
def disk(tmp_path):
    disk = Disk(tmp_path / "disk")
    yield disk
    disk.unmount()


def writing_backend(disk: Disk):
    """A torch.compile backend that runs the graph as it is but writes into inductor's cache folder, as
    inductor does; so a full disk fails it with a real ENOSPC."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        folder = Path(cache_dir()) / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        disk.write(folder / uuid.uuid4().hex, os.urandom(256 * 1024))
        return gm.forward

    return backend


@pytest.mark.parametrize("when", ["found before the compile", "ENOSPC during the compile"])
def test_the_app_says_disk_full_everywhere_and_persists_again_once_there_is_room(when, disk, tmp_path):
    root = disk.folder / "cache"
    # "found before": the real free space; "during": the check saw room, and the disk filled meanwhile.
    free = disk.free_bytes if when == "found before the compile" else (lambda path: 10_000 * MiB)

    def build(settings):
        cache = configure_cache_env(settings.cache_dir)  # in os.environ, as app.py does; served() restores it
        loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
        return local_engine(loaded, presets=settings.resolutions, backend=writing_backend(disk), cache=cache,
                            compile_folder=CompileFolder(cache, free=free))

    with served(root, engine=build) as s:
        assert s.engine.status().persistent_cache and s.metric("neuron_ui_cache_persistent") == 1
        disk.fill()

        result = s.engine.generate(GenerateRequest("a fox", "256x256", steps=1, seed=1))

        assert result.cache_event == "compiled" and result.image.size == (256, 256)
        status = s.engine.status()
        assert status.persistent_cache is False and status.cache_error.startswith(FULL)
        assert s.metric("neuron_ui_cache_persistent") == 0
        assert "not persistent" in s.handlers().on_tick("256x256", None)[1]
        assert not status.shape("256x256").on_disk  # nothing kept, so nothing recorded
        assert not list((root / "inductor" / "kernels").glob("*"))

        disk.free_up()
        s.engine.generate(GenerateRequest("a fox", "384x256", steps=1, seed=1))

        status = s.engine.status()
        assert status.persistent_cache and status.cache_error is None
        assert s.metric("neuron_ui_cache_persistent") == 1
        assert "not persistent" not in s.handlers().on_tick("256x256", None)[1]
        assert status.shape("384x256").on_disk and not status.shape("256x256").on_disk
        assert list((root / "inductor" / "kernels").glob("*"))
        assert set(CacheManifest(root / "manifest.json").entries()[s.engine.runner.key.digest]["shapes"]) == {"384x256"}


def test_a_manifest_write_that_hits_a_full_disk_recovers_with_the_next_write(tmp_path, monkeypatch):
    manifest = CacheManifest(tmp_path / "manifest.json")
    key_args = ("tiny", "regional", "eager", "float32")
    from neuron_ui.compile.key import CompileKey

    key = CompileKey.current(*key_args)
    real_fsync = os.fsync

    def no_room(fd):
        raise no_space()

    monkeypatch.setattr(os, "fsync", no_room)  # the library call fails, as on a full disk
    manifest.record(key, "256x256", 256, 1.0, "compiled")
    assert not manifest.persistent and "No space left" in manifest.error

    monkeypatch.setattr(os, "fsync", real_fsync)
    manifest.record(key, "384x256", 384, 1.0, "compiled")
    assert manifest.persistent and manifest.error is None
    assert set(CacheManifest(tmp_path / "manifest.json").shapes(key)) == {"256x256", "384x256"}
