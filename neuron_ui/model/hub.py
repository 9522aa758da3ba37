"""What `--model` means on this machine, and whether the Hub answers, within a bound; no torch, no diffusers: the
cache commands key a folder with it without importing the model's libraries.

Why the bound: huggingface_hub's `hf_hub_download` retries a file it does not have in its cache with back-off when
the network fails (file_download._get_metadata_or_catch_error, retry_on_errors=True in huggingface_hub 2.4): about
23 s and 10 warnings before it gives up on a Hub that cannot be reached. One request without retries
(`get_hf_file_metadata`, retry_on_errors=False by default; `model_info`), bounded by a thread's wait as well as the
request's timeout (DNS and proxies can ignore the latter), says so in one line instead.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from neuron_ui.config.processes import in_daemon_thread
from neuron_ui.contract.errors import first_line

logger = logging.getLogger(__name__)

TINY = "tiny"
RANDOM_KLEIN = "random-klein-4b"
AUTO = "auto"
HUB_MODEL_ID = "black-forest-labs/FLUX.2-klein-4B"


def hub_silence(repo: str, filename: str, timeout: float, endpoint: str | None = None) -> str | None:
    """Why the Hub did not answer a request for this file within `timeout` s (a style's, `--lora owner/repo`);
    None when it answered anything, an error status included (the download then says which), or when offline mode
    asks nothing of it."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():  # hf_hub_download reads the cache alone, at once
        return None
    url = hf_hub_url(repo, filename, endpoint=endpoint)
    try:
        in_daemon_thread(lambda: get_hf_file_metadata(url, timeout=timeout, endpoint=endpoint),
                         "lora-hub-probe").result(timeout)
    except HfHubHTTPError:
        pass  # an answer: no such repo or file, no access... the download's own error names it
    except Exception as error:  # noqa: BLE001 - a refused connection, a timeout, DNS: no answer
        if _is_timeout(error):  # the request's own timeout is our bound: say it in the bound's words
            return f"the Hub did not answer within {timeout:g} s"
        return f"the Hub cannot be reached ({first_line(error)})"
    return None


def _is_timeout(error: BaseException) -> bool:
    """The wait's, httpx's and the socket's timeouts, whichever fires first, and any they were raised from."""
    import httpx

    chain: BaseException | None = error
    for _ in range(8):  # a chain is short; a cycle in one must not hang the probe
        if isinstance(chain, (TimeoutError, FutureTimeout, httpx.TimeoutException)):
            return True
        chain = chain and (chain.__cause__ or chain.__context__)
    return False


@dataclass(frozen=True)
class ModelChoice:
    """What `--model` resolved to: where to load from, the name that keys compile caches, and why."""

    source: str  # TINY, a hub repo id or a local folder
    name: str  # the same with --transformer: compiled graphs take the weights as inputs, not constants
    fallback_reason: str | None = None
    transformer: str | None = None  # --transformer: BFL's single file, the rest from `source`


def choose_model(model: str, hub_timeout: float = 5.0, transformer: str | None = None) -> ModelChoice:
    """Decide what `--model` means on this machine, without loading anything: auto is a folder named like the Hub's
    model, a complete copy of it in the local Hugging Face cache, or the Hub if it answers within `hub_timeout` s;
    else the tiny model. `transformer` (--transformer) rides along."""
    from huggingface_hub import HfApi, snapshot_download

    def chosen(source: str, name: str = HUB_MODEL_ID, why: str | None = None) -> ModelChoice:
        return ModelChoice(source, name, why, transformer)

    if model != AUTO:
        return chosen(model, model)
    if Path(HUB_MODEL_ID).is_dir():
        return chosen(HUB_MODEL_ID)
    with suppress(Exception):  # not cached (or partly): the Hub is asked next, without touching the network here
        return chosen(snapshot_download(HUB_MODEL_ID, local_files_only=True))
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):  # huggingface_hub asks nothing
        return chosen(TINY, TINY, f"HF_HUB_OFFLINE is set, so the Hub was not asked, and {HUB_MODEL_ID} is not in "
                                  "the local cache")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
    try:  # the wait bounds it too: DNS and proxies can ignore the request's timeout
        in_daemon_thread(lambda: api.model_info(HUB_MODEL_ID, timeout=hub_timeout), "hub-probe").result(hub_timeout)
    except Exception as error:  # noqa: BLE001 - no answer, or not a yes: the tiny model
        logger.info("the Hub did not answer for %s: %s", HUB_MODEL_ID, first_line(error))
        return chosen(TINY, TINY, f"{HUB_MODEL_ID} is not in the local cache and the Hub did not answer within "
                                  f"{hub_timeout:g} s")
    return chosen(HUB_MODEL_ID)
