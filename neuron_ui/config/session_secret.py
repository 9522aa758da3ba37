"""The key that the browsers' stored sessions (gr.BrowserState) are encrypted with, kept across restarts.

Without one, Gradio draws a random key per process, so a restart made every browser's stored prompt, size and history
unreadable. The key comes from NEURON_UI_SESSION_SECRET (Settings.session_secret) or from a file in the cache folder,
made once with mode 0600. A new key costs every browser its stored session: it starts fresh, nothing worse.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)

SECRET_FILE = "session-secret"
_WELL_FORMED = re.compile(r"[A-Za-z0-9_-]{32,128}")


def load_session_secret(cache_dir: Path, given: str | None = None) -> str:
    """`given` if set; else the cache folder's key, made (atomically, 0600) when missing or malformed. A cache folder
    that cannot keep it gets a key for this process only (the sessions then last until the next restart)."""
    if given:
        return given
    path = Path(cache_dir) / SECRET_FILE
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = None
    except (OSError, UnicodeDecodeError) as error:
        logger.warning("cannot read %s (%s): browsers' stored sessions will not survive a restart", path, error)
        return secrets.token_urlsafe(32)
    if text is not None and _WELL_FORMED.fullmatch(text):
        return text
    if text is not None:
        logger.warning("%s is malformed: a new session key is made (browsers' stored sessions start fresh)", path)
    return _create(path, replace=text is not None)


def _create(path: Path, replace: bool) -> str:
    """A new key written to a 0600 temp file, then moved into place: a reader never sees half a key, and of two
    processes starting at once the first to link wins and the other reads its key."""
    secret = secrets.token_urlsafe(32)
    temp = path.with_name(f".{SECRET_FILE}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as file:
            file.write(secret + "\n")
        (os.replace if replace else os.link)(temp, path)  # a link fails if another process made the key meanwhile
    except FileExistsError:
        return load_session_secret(path.parent)
    except OSError as error:
        logger.warning("cannot keep a session key in %s (%s): browsers' stored sessions will not survive a restart",
                       path.parent, error)
    finally:
        temp.unlink(missing_ok=True)
    return secret
