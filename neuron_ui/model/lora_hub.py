"""Whether the Hub answers, asked once within a bound, before a style's file is downloaded (`--lora owner/repo`).

Why: huggingface_hub's `hf_hub_download` retries a file it does not have in its cache with back-off when the
network fails (file_download._get_metadata_or_catch_error, retry_on_errors=True in huggingface_hub 2.4): about
23 s and 10 warnings before it gives up on a Hub that cannot be reached. One metadata request without retries
(`get_hf_file_metadata`, retry_on_errors=False by default), bounded by a thread's join as well as the request's
timeout (DNS and proxies can ignore the latter), says so in one line instead.
"""

from __future__ import annotations

import threading
from pathlib import Path

from neuron_ui.contract.errors import first_line


def hub_silence(repo: str, filename: str, timeout: float, endpoint: str | None = None) -> str | None:
    """Why the Hub did not answer a request for this file within `timeout` s; None when it answered anything,
    an error status included (the download then says which), or when offline mode asks nothing of it."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():  # hf_hub_download reads the cache alone, at once
        return None
    failures: list[str] = []
    answered = threading.Event()

    def ask() -> None:
        try:
            get_hf_file_metadata(hf_hub_url(repo, filename, endpoint=endpoint), timeout=timeout, endpoint=endpoint)
        except HfHubHTTPError:
            pass  # an answer: no such repo or file, no access... the download's own error names it
        except Exception as error:  # noqa: BLE001 - a refused connection, a timeout, DNS: no answer
            if not _is_timeout(error):  # the request's own timeout is our bound: say it in the bound's words
                failures.append(first_line(error))
            return
        answered.set()

    thread = threading.Thread(target=ask, daemon=True, name="lora-hub-probe")
    thread.start()
    thread.join(timeout)
    if answered.is_set():
        return None
    if failures:
        return f"the Hub cannot be reached ({failures[0]})"
    return f"the Hub did not answer within {timeout:g} s"


def _is_timeout(error: BaseException) -> bool:
    """httpx's and the socket's timeouts, whichever fires first, and any they were raised from."""
    import httpx

    chain: BaseException | None = error
    for _ in range(8):  # a chain is short; a cycle in one must not hang the probe
        if chain is None:
            return False
        if isinstance(chain, (TimeoutError, httpx.TimeoutException)):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


def cached_file(repo: str, filename: str) -> Path | None:
    """The file from the local Hugging Face cache, without touching the network; None when it is not there."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or only partly): the caller says so in its line
        return None
