"""Download a pinned bundle into the cache folder: streamed, resumed, bounded in size and time, checked by its sha256.

The bytes go to a file in a staging folder inside the cache folder (the same disk the bundle unpacks to; a folder,
so the sweep at the next start removes it if the process was killed), never into memory. A try that times out,
loses its connection or meets a 5xx is tried again after a back-off, resuming with a Range request where the server
allows it. The whole download has a size cap and a deadline, and each try a minimum rate (fetch_bounds.py), which
no number of tries can stretch. The caller gets the file only once its sha256 is the pinned one; on any failure
(an exception, SIGTERM unwinding) the staging folder is gone.
"""

from __future__ import annotations

import hashlib
import io
import logging
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import httpx

from neuron_ui.cache.admin import human_bytes
from neuron_ui.cache.bundle_format import BUNDLE_JSON, MAX_BUNDLE_JSON, BundleError, check_key, read_header
from neuron_ui.cache.bundle_source import resolve_url
from neuron_ui.cache.fetch_bounds import Watchdog
from neuron_ui.config.cache_paths import MIN_FREE_BYTES, free_bytes, staging_prefix
from neuron_ui.contract.errors import first_line

if TYPE_CHECKING:
    from neuron_ui.cache.bundle_source import BundleSource
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.settings import Settings

logger = logging.getLogger(__name__)
# httpx logs every request at INFO with its whole URL, query included: a presigned URL's signature would reach the
# log. Its warnings still do; our own lines name a URL without its query (BundleSource.label).
logging.getLogger("httpx").setLevel(logging.WARNING)

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
LOG_EVERY = 5.0  # seconds between progress lines in the log
Progress = Callable[[int, "int | None"], None]


class FetchError(BundleError):
    """A download that failed for good; the message is one line and says nothing was kept."""


class _Retry(Exception):
    """A failure the next try may not meet: a timeout, a dropped connection, a 5xx."""


@dataclass(frozen=True)
class FetchPolicy:
    connect_timeout: float = 30.0
    read_timeout: float = 30.0  # silence mid-body this long ends the try
    tries: int = 4
    backoff: float = 2.0  # seconds before the second try, doubled before each next
    free: Callable[[Path], int] = free_bytes  # the room on the cache folder's disk (a test gives a small disk)
    max_bytes: int = 16 * 2**30  # the largest bundle taken, whatever the disk could hold
    deadline: float = 3600.0  # seconds for the whole download, tries and back-offs included
    min_rate: float = 64 * 2**10  # bytes/s: a try slower than this over `rate_window` seconds is given up
    rate_window: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> FetchPolicy:
        return cls(connect_timeout=settings.cache_bundle_timeout, read_timeout=settings.cache_bundle_timeout,
                   max_bytes=settings.cache_bundle_max_mb * 2**20, deadline=settings.cache_bundle_deadline,
                   min_rate=settings.cache_bundle_min_rate * 2**10)


class HeaderPeek:
    """bundle.json read off the download's first kilobytes, so a bundle of another compile key, or a body that is
    not gzip at all (an HTML error page), is dropped before the rest downloads. Only these two are decided here:
    anything else is left to the full, verified import once the pinned digest matched."""

    LIMIT = MAX_BUNDLE_JSON + 1024

    def __init__(self, key: CompileKey, label: str):
        self.key, self.label = key, label
        self.header: dict | None = None
        self.done = False
        self._inflate = zlib.decompressobj(wbits=31)  # gzip framing only
        self._head = bytearray()

    def feed(self, chunk: bytes) -> dict | None:
        """The bundle's header, the first time it is whole and of this key; BundleError when it is not."""
        if self.done:
            return None
        try:
            self._head += self._inflate.decompress(chunk, self.LIMIT - len(self._head))
        except zlib.error:
            raise BundleError(f"{self.label} is not a bundle: the server sent something that is not gzip "
                              f"(it starts {bytes(chunk[:40])!r}); nothing was kept") from None
        if len(self._head) < 512:
            self.done = self._inflate.eof
            return None
        try:
            member = tarfile.TarInfo.frombuf(bytes(self._head[:512]), "utf-8", "surrogateescape")
        except tarfile.TarError:
            self.done = True  # not for us to judge before the digest: the import says what is wrong
            return None
        if member.name != BUNDLE_JSON or not member.isreg() or member.size > MAX_BUNDLE_JSON:
            self.done = True
            return None
        if len(self._head) < 512 + member.size:
            self.done = self._inflate.eof or len(self._head) >= self.LIMIT
            return None
        self.done = True
        try:
            with tarfile.open(fileobj=io.BytesIO(bytes(self._head)), mode="r|") as tar:
                header = read_header(tar, self.label)
        except (ValueError, tarfile.TarError, EOFError):
            return None
        check_key(header, self.key, self.label)  # BundleError naming each field that differs
        self.header = header
        return header


class _Download:
    """The staging file and what is known of it across tries."""

    def __init__(self, path: Path, key: CompileKey, label: str, room: int, root: Path, max_bytes: int,
                 watchdog: Watchdog):
        self.path, self.key, self.label, self.room, self.root = path, key, label, room, root
        self.max_bytes, self.watchdog = max_bytes, watchdog
        self.restart()

    def restart(self) -> None:
        self.path.write_bytes(b"")
        self.done, self.sha256 = 0, hashlib.sha256()
        self.total: int | None = None  # the bundle's size once a response says it
        self.peek = HeaderPeek(self.key, self.label)

    def check_size(self, size: int, what: str) -> None:
        """The cap on a bundle's size, then the room on the disk."""
        if size > self.max_bytes:
            raise FetchError(f"{self.label}: {what} {human_bytes(size)}, more than the "
                             f"{human_bytes(self.max_bytes)} a bundle may be (--cache-bundle-max-mb); nothing was kept")
        self.check_room(size, what)

    def check_room(self, needed: int, what: str) -> None:
        if needed > self.room:
            raise FetchError(f"{self.label}: {what} {human_bytes(needed)}, more than {self.root} can take "
                             f"({human_bytes(self.room + MIN_FREE_BYTES)} free, {human_bytes(MIN_FREE_BYTES)} of it "
                             "kept spare); nothing was kept. Free some space, or publish fewer shapes.")

    def add(self, chunk: bytes, sink: BinaryIO) -> None:
        header = self.peek.feed(chunk)
        sink.write(chunk)
        self.sha256.update(chunk)
        self.done += len(chunk)
        self.watchdog.got(len(chunk))
        self.check_size(self.done, "the download passed")
        if header is not None:  # the bundle file and what it unpacks to are on this disk together for a moment
            unpacked = sum(f["size"] for f in header["files"])
            self.check_room((self.total or self.done) + unpacked, "downloading and unpacking it needs")


def fetch_bundle(source: BundleSource, sha256: str, cache: CachePaths, key: CompileKey,
                 policy: FetchPolicy | None = None, progress: Progress | None = None) -> Path:
    """Download `source` to a staging file in the cache folder and return it once its sha256 is `sha256`.

    FetchError (or BundleError: another key, not gzip) on any failure, with nothing left in the cache folder."""
    policy = policy or FetchPolicy()
    url, headers = resolve_url(source)
    timeout = httpx.Timeout(policy.read_timeout, connect=policy.connect_timeout)
    staging = Path(tempfile.mkdtemp(dir=cache.root, prefix=staging_prefix()))
    try:
        with (Watchdog(policy.deadline, policy.min_rate, policy.rate_window) as watchdog,
              httpx.Client(timeout=timeout, follow_redirects=True,
                           headers={**headers, "Accept-Encoding": "identity"}) as client):
            download = _Download(staging / "bundle.tar.gz", key, source.label,
                                 policy.free(cache.root) - MIN_FREE_BYTES, cache.root, policy.max_bytes, watchdog)
            _tries(client, url, download, policy, progress)
        got = download.sha256.hexdigest()
        if got != sha256:
            raise FetchError(f"{source.label} is not the pinned bundle: expected sha256 {sha256}, got {got} "
                             f"({human_bytes(download.done)}); nothing was kept. Pin the digest `cache publish` "
                             "printed, or check that the URL and revision are the ones you published.")
        logger.info("fetched %s: %s, sha256 as pinned", source.label, human_bytes(download.done))
        return download.path
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def discard(fetched: Path) -> None:
    """Remove what fetch_bundle returned, with its staging folder (the file may already have been moved away)."""
    shutil.rmtree(fetched.parent, ignore_errors=True)


def _tries(client: httpx.Client, url: str, download: _Download, policy: FetchPolicy, progress: Progress | None) -> None:
    """Try, back off and resume until the download is whole; FetchError once the tries or the time are spent."""
    watchdog = download.watchdog
    for attempt in range(1, policy.tries + 1):
        watchdog.start_try()
        try:
            _get(client, url, download, policy, progress)
            return
        except _Retry as error:
            if watchdog.reason is not None:
                break
            if attempt == policy.tries:
                raise FetchError(f"{download.label}: {error}, {policy.tries} tries; nothing was kept") from None
            wait = policy.backoff * 2 ** (attempt - 1)
            if wait >= watchdog.remaining():
                break
            logger.info("fetching %s: %s; trying again in %.1f s (try %d of %d)", download.label, error,
                        wait, attempt + 1, policy.tries)
            time.sleep(wait)
        finally:
            watchdog.end_try()
    reason = watchdog.reason or f"not done within {policy.deadline:g} s (--cache-bundle-deadline)"
    raise FetchError(f"{download.label}: {reason} after {human_bytes(download.done)}; nothing was kept")


def _get(client: httpx.Client, url: str, download: _Download, policy: FetchPolicy, progress: Progress | None) -> None:
    """One try: GET (from where the last one stopped), streaming into the staging file."""
    resume = {"Range": f"bytes={download.done}-"} if download.done else {}
    logged = time.monotonic()
    try:
        with client.stream("GET", url, headers=resume,
                           extensions={"trace": download.watchdog.trace}) as response:
            _check_response(response, download)
            with open(download.path, "ab") as sink:
                for chunk in response.iter_raw():  # as it arrives: a chunk_size would buffer, and lose it on a cut
                    download.add(chunk, sink)
                    if progress is not None:
                        progress(download.done, download.total)
                    if time.monotonic() - logged > LOG_EVERY:
                        logged = time.monotonic()
                        logger.info("fetching %s: %s of %s", download.label, human_bytes(download.done),
                                    human_bytes(download.total) if download.total else "an unknown size")
    except httpx.ConnectTimeout:
        raise _Retry(f"no connection within {policy.connect_timeout:g} s") from None
    except httpx.TimeoutException:
        raise _Retry(f"the server stalled: nothing for {policy.read_timeout:g} s after "
                     f"{human_bytes(download.done)}") from None
    except httpx.UnsupportedProtocol as error:
        raise FetchError(f"{download.label}: {first_line(error)}; nothing was kept") from None
    except httpx.TransportError as error:  # refused, DNS, reset, a body cut short of its Content-Length
        raise _Retry(f"{first_line(error)[:200]} after {human_bytes(download.done)}") from None
    except httpx.TooManyRedirects:
        raise FetchError(f"{download.label}: too many redirects; nothing was kept") from None
    except httpx.InvalidURL as error:  # a redirect to `data:,x` or `http://[::1`: not an HTTPError in httpx
        raise FetchError(f"{download.label}: the server sent an unusable URL ({first_line(error)[:200]}); "
                         "nothing was kept") from None
    if download.watchdog.reason is not None:  # a body without a length ends as the watchdog shuts it
        raise _Retry(download.watchdog.reason)
    if download.total is not None and download.done != download.total:
        raise _Retry(f"the connection closed after {download.done} of {download.total} bytes")


def _check_response(response: httpx.Response, download: _Download) -> None:
    """Take a 200 or the 206 that resumes us; retry what may pass, refuse the rest in one line."""
    code, length = response.status_code, response.headers.get("content-length")
    if code == 206 and download.done:
        start, _, total = response.headers.get("content-range", "").removeprefix("bytes ").partition("/")
        if start.partition("-")[0] != str(download.done):
            download.restart()
            raise _Retry("the server resumed at another offset")
        download.total = int(total) if total.isdigit() else None
    elif code == 200:
        if download.done:
            logger.info("fetching %s: the server does not resume downloads; starting again", download.label)
            download.restart()
        download.total = int(length) if length and length.isdigit() else None
    elif code == 416 and download.done:
        download.restart()
        raise _Retry("the server refused to resume")
    elif code in RETRY_STATUS:
        raise _Retry(f"HTTP {code} {response.reason_phrase}")
    else:
        hint = {401: ": a private or gated repo needs HF_TOKEN (or a URL that needs no login)",
                403: ": a private or gated repo needs HF_TOKEN with access to it",
                404: ": check the path and the revision"}.get(code, "")
        raise FetchError(f"{download.label}: HTTP {code} {response.reason_phrase}{hint}; nothing was kept")
    if download.total is not None:
        download.check_size(download.total, "the server announces")
