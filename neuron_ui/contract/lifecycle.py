"""The lifecycle of an engine that serves once built (EngineLike's start and stop): nothing to begin or end."""

from __future__ import annotations


class ServesOnceBuilt:
    """For an engine in this process, and for the replicas' client (neuron_ui.serving stops the Ray it started)."""

    def start(self) -> None:
        """Nothing to begin: serving starts with the constructor."""

    def stop(self, at_once: bool = False) -> None:
        """Nothing to end: no other process is this object's to stop."""
