"""Where a bundle comes from (a local file, an http(s):// URL, or a Hub file: hf://, resolved by huggingface_hub), and
the download of a remote one, pinned, into the cache folder: streamed, resumed, bounded in size and time, checked by
its sha256 (by the import, which the caller runs next).

The bytes go to a file in a staging folder inside the cache folder (the same disk the bundle unpacks to; a folder,
so the sweep at the next start removes it if the process was killed), never into memory. A try that times out,
loses its connection or meets a 5xx is tried again after a back-off, resuming with a Range request where the server
allows it. The whole download has a size cap and a deadline, and each try a minimum rate (fetch_bounds.py), which
no number of tries can stretch. On any failure (an exception, SIGTERM unwinding) the staging folder is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urlsplit

import httpx

from neuron_ui.cache.admin import human_bytes
from neuron_ui.cache.bundle_format import BundleError, HeaderPeek, check_room
from neuron_ui.cache.fetch_bounds import Watchdog
from neuron_ui.config.cache_paths import free_bytes, staging_folder
from neuron_ui.contract.errors import first_line

if TYPE_CHECKING:
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.settings import Settings

logger = logging.getLogger(__name__)
# httpx logs every request at INFO with its whole URL, query included: a presigned URL's signature would reach the
# log. Its warnings still do; our own lines name a URL without its query (BundleSource.label).
logging.getLogger("httpx").setLevel(logging.WARNING)

HUB_SCHEME = "hf://"
URL_SCHEMES = ("https://", "http://")
HUB_PREFIXES = {"datasets/": "dataset", "spaces/": "space", "models/": "model"}
HUB_FORM = "hf://[datasets/|spaces/]<owner>/<repo>/<path in repo>[@revision]"
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
LOG_EVERY = 5.0  # seconds between progress lines in the log
Progress = Callable[[int, "int | None"], None]


@dataclass(frozen=True)
class BundleSource:
    """One --cache-bundle item, parsed; `text` is what the user wrote, used in every message."""

    text: str
    kind: str  # "file", "url" or "hub"
    repo_id: str = ""
    repo_type: str = "model"
    filename: str = ""
    revision: str | None = None

    @property
    def label(self) -> str:
        """The source for messages and logs: a URL without its query or login, which may hold a signature."""
        if self.kind != "url":
            return self.text
        parts = urlsplit(self.text)
        query = "?..." if parts.query else ""
        return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}{query}"


def parse_bundle_source(text: str) -> BundleSource:
    """A file path, an http(s):// URL or HUB_FORM; ValueError naming the expected form otherwise."""
    if text.startswith(URL_SCHEMES):
        return BundleSource(text, "url")
    if not text.startswith(HUB_SCHEME):
        if "://" in text:
            raise ValueError(f"{text[:200]!r}: a bundle is a file, an https:// or http:// URL, or {HUB_FORM}")
        return BundleSource(text, "file")
    rest, revision = text[len(HUB_SCHEME):], None
    if "@" in rest:  # the revision follows the last @ and may hold slashes (refs/pr/3)
        rest, _, revision = rest.rpartition("@")
    repo_type = "model"
    for prefix, kind in HUB_PREFIXES.items():
        if rest.startswith(prefix):
            rest, repo_type = rest[len(prefix):], kind
            break
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts) or revision == "" or "@" in rest:
        raise ValueError(f"{text[:200]!r} is not a Hub file: write {HUB_FORM}, e.g. "
                         "hf://my-org/neuron-ui-caches/trn2/klein-regional.tar.gz@main")
    return BundleSource(text, "hub", repo_id="/".join(parts[:2]), repo_type=repo_type, filename="/".join(parts[2:]),
                        revision=revision)


def resolve_url(source: BundleSource) -> tuple[str, dict[str, str]]:
    """The URL to GET and the headers to send; a Hub file's through huggingface_hub (HF_ENDPOINT, HF_TOKEN).

    huggingface_hub builds the resolve URL and the token header; the bytes then go through this module's own
    download, so staging, resume, the size cap and progress are the same for the Hub and for plain URLs."""
    if source.kind == "url":
        return source.text, {}
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import HFValidationError, build_hf_headers, validate_repo_id

    if constants.HF_HUB_OFFLINE:
        raise ValueError("HF_HUB_OFFLINE is set, so the Hub is not asked; unset it to fetch a bundle from the Hub")
    try:
        validate_repo_id(source.repo_id)
    except HFValidationError as error:
        raise ValueError(f"{source.repo_id[:100]!r} is not a Hub repo id ({str(error).splitlines()[0]})") from None
    url = hf_hub_url(source.repo_id, source.filename, repo_type=source.repo_type, revision=source.revision)
    return url, build_hf_headers()


class _Retry(Exception):
    """A failure the next try may not meet: a timeout, a dropped connection, a 5xx."""


@dataclass(frozen=True)
class FetchPolicy:
    """How long a download may take and how much it may bring (the --cache-bundle-* flags), and how it retries."""

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


class _Download:
    """One download into the staging file: its tries, and what is known of the bundle across them."""

    watchdog: Watchdog  # the try's under way

    def __init__(self, client: httpx.Client, url: str, path: Path, source: BundleSource, key: CompileKey,
                 root: Path, policy: FetchPolicy, progress: Progress | None):
        self.client, self.url, self.path, self.label, self.key = client, url, path, source.label, key
        self.root, self.policy, self.progress = root, policy, progress
        self.free = policy.free(root)
        self.restart()

    def restart(self) -> None:
        self.path.write_bytes(b"")
        self.done = 0
        self.total: int | None = None  # the bundle's size once a response says it
        self.peek = HeaderPeek(self.key, self.label)

    def check_size(self, size: int, what: str) -> None:
        """The cap on a bundle's size, then the room on the disk."""
        if size > self.policy.max_bytes:
            raise BundleError(f"{self.label}: {what} {human_bytes(size)}, more than the "
                             f"{human_bytes(self.policy.max_bytes)} a bundle may be (--cache-bundle-max-mb); "
                             "nothing was kept")
        check_room(self.root, self.free, size, f"{self.label}: {what}")

    def add(self, chunk: bytes, sink: BinaryIO) -> None:
        header = self.peek.feed(chunk)
        sink.write(chunk)
        self.done += len(chunk)
        self.watchdog.got(len(chunk))
        self.check_size(self.done, "the download passed")
        if header is not None:  # the bundle file and what it unpacks to are on this disk together for a moment
            check_room(self.root, self.free, (self.total or self.done) + header.bytes,
                       f"{self.label}: downloading and unpacking it needs")
        if self.progress is not None:
            self.progress(self.done, self.total)

    def run(self) -> None:
        """Try, back off and resume until the download is whole; BundleError once the tries or the time are spent."""
        policy, started = self.policy, time.monotonic()
        for attempt in range(1, policy.tries + 1):
            # A watchdog per try: the rate counts from each try's start, the back-off is not the server's slowness.
            with Watchdog(policy.deadline, policy.min_rate, policy.rate_window, started=started) as self.watchdog:
                try:
                    self._get()
                    return
                except _Retry as error:
                    failure = error
            if self.watchdog.reason is not None:
                break
            if attempt == policy.tries:
                raise BundleError(f"{self.label}: {failure}, {policy.tries} tries; nothing was kept") from None
            wait = policy.backoff * 2 ** (attempt - 1)
            if wait >= self.watchdog.remaining():
                break
            logger.info("fetching %s: %s; trying again in %.1f s (try %d of %d)", self.label, failure,
                        wait, attempt + 1, policy.tries)
            time.sleep(wait)
        reason = self.watchdog.reason or f"not done within {policy.deadline:g} s (--cache-bundle-deadline)"
        raise BundleError(f"{self.label}: {reason} after {human_bytes(self.done)}; nothing was kept")

    def _get(self) -> None:
        """One try: GET (from where the last one stopped), streaming into the staging file."""
        resume = {"Range": f"bytes={self.done}-"} if self.done else {}
        logged = time.monotonic()
        try:
            with self.client.stream("GET", self.url, headers=resume,
                                    extensions={"trace": self.watchdog.trace}) as response:
                self._check_response(response)
                with open(self.path, "ab") as sink:
                    for chunk in response.iter_raw():  # as it arrives: a chunk_size would buffer, and lose it on a cut
                        self.add(chunk, sink)
                        if time.monotonic() - logged > LOG_EVERY:
                            logged = time.monotonic()
                            logger.info("fetching %s: %s of %s", self.label, human_bytes(self.done),
                                        human_bytes(self.total) if self.total else "an unknown size")
        except httpx.ConnectTimeout:
            raise _Retry(f"no connection within {self.policy.connect_timeout:g} s") from None
        except httpx.TimeoutException:
            raise _Retry(f"the server stalled: nothing for {self.policy.read_timeout:g} s after "
                         f"{human_bytes(self.done)}") from None
        except httpx.UnsupportedProtocol as error:
            raise BundleError(f"{self.label}: {first_line(error)}; nothing was kept") from None
        except httpx.TransportError as error:  # refused, DNS, reset, a body cut short of its Content-Length
            raise _Retry(f"{first_line(error)[:200]} after {human_bytes(self.done)}") from None
        except httpx.TooManyRedirects:
            raise BundleError(f"{self.label}: too many redirects; nothing was kept") from None
        except httpx.InvalidURL as error:  # a redirect to `data:,x` or `http://[::1`: not an HTTPError in httpx
            raise BundleError(f"{self.label}: the server sent an unusable URL ({first_line(error)[:200]}); "
                             "nothing was kept") from None
        if self.watchdog.reason is not None:  # a body without a length ends as the watchdog shuts it
            raise _Retry(self.watchdog.reason)
        if self.total is not None and self.done != self.total:
            raise _Retry(f"the connection closed after {self.done} of {self.total} bytes")

    def _check_response(self, response: httpx.Response) -> None:
        """Take a 200 or the 206 that resumes us; retry what may pass, refuse the rest in one line."""
        code, length = response.status_code, response.headers.get("content-length")
        if code == 206 and self.done:
            start, _, total = response.headers.get("content-range", "").removeprefix("bytes ").partition("/")
            if start.partition("-")[0] != str(self.done):
                self.restart()
                raise _Retry("the server resumed at another offset")
            self.total = int(total) if total.isdigit() else None
        elif code == 200:
            if self.done:
                logger.info("fetching %s: the server does not resume downloads; starting again", self.label)
                self.restart()
            self.total = int(length) if length and length.isdigit() else None
        elif code == 416 and self.done:
            self.restart()
            raise _Retry("the server refused to resume")
        elif code in RETRY_STATUS:
            raise _Retry(f"HTTP {code} {response.reason_phrase}")
        else:
            hint = {401: ": a private or gated repo needs HF_TOKEN (or a URL that needs no login)",
                    403: ": a private or gated repo needs HF_TOKEN with access to it",
                    404: ": check the path and the revision"}.get(code, "")
            raise BundleError(f"{self.label}: HTTP {code} {response.reason_phrase}{hint}; nothing was kept")
        if self.total is not None:
            self.check_size(self.total, "the server announces")


@contextmanager
def fetch_bundle(source: BundleSource, cache: CachePaths, key: CompileKey, policy: FetchPolicy | None = None,
                 progress: Progress | None = None) -> Iterator[Path]:
    """Download `source` to a staging file in the cache folder, whole (its pin is the import's to check), for the
    `with` block; the staging folder goes when the block ends, and on any failure (BundleError, one line)."""
    policy = policy or FetchPolicy()
    url, headers = resolve_url(source)
    timeout = httpx.Timeout(policy.read_timeout, connect=policy.connect_timeout)
    with staging_folder(cache.root) as staging:
        with httpx.Client(timeout=timeout, follow_redirects=True,
                          headers={**headers, "Accept-Encoding": "identity"}) as client:
            download = _Download(client, url, staging / "bundle.tar.gz", source, key, cache.root, policy, progress)
            download.run()
        logger.info("fetched %s: %s", source.label, human_bytes(download.done))
        yield download.path
