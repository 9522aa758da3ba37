"""Where a bundle comes from: a local file, an http(s):// URL, or a Hub file (hf://, resolved by huggingface_hub)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

HUB_SCHEME = "hf://"
URL_SCHEMES = ("https://", "http://")
HUB_PREFIXES = {"datasets/": "dataset", "spaces/": "space", "models/": "model"}
HUB_FORM = "hf://[datasets/|spaces/]<owner>/<repo>/<path in repo>[@revision]"


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
    def remote(self) -> bool:
        return self.kind != "file"

    @property
    def label(self) -> str:
        """The source for messages and logs: a URL without its query or login, which may hold a signature."""
        if self.kind != "url":
            return self.text
        parts = urlsplit(self.text)
        query = "?..." if parts.query else ""
        return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}{query}"

    @property
    def path(self) -> Path:
        return Path(self.text).expanduser()


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

    huggingface_hub builds the resolve URL and the token header; the bytes then go through fetch.py's own
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
