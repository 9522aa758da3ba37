"""What the gate is given by the server, by name and typed: the mounted UI and the server's few facts the gate reads.

The gate (gate.py) and its file checks (file_doors.py) once took the whole server as `Any` and read a dozen of its
members; `GateServer` is all they may read, and `Mounted` is the UI as the server serves it, handed in whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import gradio as gr
    from gradio.routes import App

    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.files import StoredFiles
    from neuron_ui.contract.stopping import SessionStops
    from neuron_ui.server.admission import Admission
    from neuron_ui.web.uploads import UploadFolder


@dataclass(frozen=True)
class Mounted:
    """The UI once it is served: the queued demo, Gradio's own app mounted at / (gradio.routes.App) and the UI's
    registry of running requests by session, which a client's cancel or disconnect stops."""

    demo: gr.Blocks
    gradio_app: App
    stops: SessionStops


class GateServer(Protocol):
    """What the gate reads of the server (neuron_ui.server.server.Server)."""

    settings: Settings  # the login (auth) and the device's bound (max_queue)
    files_prefix: str  # the server's file folder, cut from every answer
    stored: StoredFiles  # the only files a request may name
    uploads: UploadFolder  # the uploads' disk budget
    mounted: Mounted | None  # None while the model loads
    draining: bool  # shutting down: no new work
    admission: Admission  # the device's bound (--max-queue), over Gradio's requests and MCP's
