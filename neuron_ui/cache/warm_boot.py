"""--cache-bundle at start-up and `cache import`: local files, URLs and Hub files, each remote one pinned by sha256.

Several bundles may be given (one per node type or compile key): each whose key matches is imported, the others are
skipped with one line each. A fetched bundle is kept by its digest in `<cache>/bundles/` once imported, so a
restart downloads nothing. Processes sharing a cache folder (replicas) import one at a time, under a lock in the
folder: the first downloads, the later ones find the kept bundle and import it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_ui.cache.admin import cache_folders, hash_file, key_for_settings
from neuron_ui.cache.bundle_format import BundleError
from neuron_ui.cache.bundle_import import import_bundle
from neuron_ui.cache.fetch import FetchPolicy, fetch_bundle, parse_bundle_source
from neuron_ui.contract.errors import first_line
from neuron_ui.contract.engine_like import LoadingState

if TYPE_CHECKING:
    from neuron_ui.cache.bundle_format import BundleInfo
    from neuron_ui.cache.fetch import BundleSource
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.settings import Settings

logger = logging.getLogger(__name__)

FETCHING, IMPORTING = "fetching compile cache", "importing compile cache"
UNPINNED = ("a remote bundle is imported only with its --cache-bundle-sha256 (it carries compiled code this app "
            "runs); nothing was fetched. `cache publish` prints the digest")


@dataclass
class BundleOutcome:
    """What became of one --cache-bundle item: imported (`info`) or refused (`problem`, one line)."""

    source: str
    info: BundleInfo | None = None
    problem: str | None = None  # naming the bundle
    origin: str = ""  # "file", "downloaded", or "kept" (fetched by an earlier start)


def kept_path(cache: CachePaths, sha256: str) -> Path:
    return cache_folders(cache)["bundles"] / f"{sha256}.tar.gz"


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM ends an import as Ctrl-C does, by an exception, so its staging goes with it, where no handler is set
    (`cache import`; the app has its own, which unwinds while loading). Its default would end the process where it
    stands, leaving a half-downloaded bundle in the cache folder."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(number: int, _frame: object) -> None:
        raise SystemExit(128 + number)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def import_at_start(settings: Settings, cache: CachePaths, loading: LoadingState | None = None,
                    policy: FetchPolicy | None = None) -> list[BundleOutcome]:
    """Import --cache-bundle before the engine reads the manifest; whatever goes wrong, the app starts (cold)."""
    try:
        outcomes = import_bundles(cache, key_for_settings(settings), settings.cache_bundle,
                                  settings.cache_bundle_sha256, policy or FetchPolicy.from_settings(settings), loading)
    except (ValueError, OSError) as error:
        logger.warning("not using --cache-bundle: %s; starting cold", first_line(error))
        return []
    except Exception:  # a bug of ours must not keep the app from starting either
        logger.exception("not using --cache-bundle: importing it failed unexpectedly; starting cold")
        return []
    # One line per bundle; a lone refused bundle's line also says the app starts cold.
    imported = any(o.info for o in outcomes)
    for o in outcomes:
        if o.info is not None:
            how = {"file": "a local file", "downloaded": "downloaded",
                   "kept": "fetched by an earlier start, nothing downloaded"}[o.origin]
            logger.info("imported --cache-bundle %s (%s): shapes added %s", o.source, how,
                        ", ".join(o.info.added_shapes) or "none (all were here)")
        else:
            cold = "; starting cold" if not imported and len(outcomes) == 1 else ""
            logger.warning("not using --cache-bundle: %s%s", o.problem, cold)
    if not imported and len(outcomes) > 1:
        logger.warning("none of the %d --cache-bundle items was imported; starting cold", len(outcomes))
    return outcomes


def import_bundles(cache: CachePaths, key: CompileKey, bundles: tuple[str, ...], pins: tuple[str, ...] = (),
                   policy: FetchPolicy | None = None, loading: LoadingState | None = None) -> list[BundleOutcome]:
    """Import each bundle that matches `key`, in order, under the folder's lock; `pins[i]` pins `bundles[i]`."""
    pins, policy = pins or ("",) * len(bundles), policy or FetchPolicy()
    (cache.root / "locks").mkdir(parents=True, exist_ok=True)
    with sigterm_unwinds(), open(cache.root / "locks" / "bundle-import.lock", "w") as lock:
        # one importer per cache folder; released when the file closes, or by the kernel if the process dies
        fcntl.flock(lock, fcntl.LOCK_EX)
        return [_import_one(cache, key, text, pin, policy, loading) for text, pin in zip(bundles, pins)]


def _import_one(cache: CachePaths, key: CompileKey, text: str, pin: str, policy: FetchPolicy,
                loading: LoadingState | None) -> BundleOutcome:
    shown = text[:200]
    try:
        source = parse_bundle_source(text)
        shown = source.label  # a URL's query (a signature) never reaches the log
        if source.kind == "file":
            return BundleOutcome(shown, import_bundle(cache, key, Path(text).expanduser(), pin or None), origin="file")
        if not pin:
            return BundleOutcome(shown, problem=f"{shown}: {UNPINNED}")
        kept = kept_path(cache, pin)
        if kept.is_file():
            if hash_file(kept)[1] == pin:
                return BundleOutcome(shown, import_bundle(cache, key, kept, pin, label=shown), origin="kept")
            logger.warning("%s does not hold what its name says (damaged on disk?): fetching it again", kept)
            kept.unlink()
        return BundleOutcome(shown, _fetch_and_import(cache, key, source, pin, policy, loading), origin="downloaded")
    except (ValueError, OSError) as error:
        why = str(error) if isinstance(error, BundleError) else first_line(error)
        return BundleOutcome(shown, problem=why if shown in why else f"{shown}: {why}")


def _fetch_and_import(cache: CachePaths, key: CompileKey, source: BundleSource, pin: str, policy: FetchPolicy,
                      loading: LoadingState | None) -> BundleInfo:
    """Download to a staging file, import it, and keep it by digest only once imported: a refused one leaves nothing."""
    state = loading or LoadingState()  # nobody reads it: a plain `cache import`
    state.set(FETCHING, 0, None)
    try:
        with fetch_bundle(source, cache, key, policy, lambda done, total: state.set(FETCHING, done, total)) as staged:
            state.set(IMPORTING)
            info = import_bundle(cache, key, staged, pin, label=source.label)
            kept = kept_path(cache, pin)
            try:
                kept.parent.mkdir(exist_ok=True)
                os.replace(staged, kept)
            except OSError as error:  # imported all the same; only the next start downloads again
                logger.warning("could not keep %s as %s (%s): a restart will download it again", source.label,
                               kept, first_line(error))
    finally:
        state.clear()
    return info
