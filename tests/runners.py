"""What tests build engines from: the engine in this process over a LocalRunner, and the base for a pipeline runner
around the engine's own (tests/serving.py's gated one, the browser tests' held one); light, so the plugins can import
it before anything loads Gradio."""


def local_engine(*args, max_queue_per_user: int | None = None, **kwargs):
    """The engine in this process: the front of a LocalRunner built with these arguments."""
    from neuron_ui.engine.engine import Engine
    from neuron_ui.engine.local import LocalRunner

    return Engine(LocalRunner(*args, **kwargs), max_queue_per_user)


class RunnerWrapper:
    """A runner around another (the engine's pipeline runner), passing calls through: what tests subclass to hold,
    time or slow calls, handed to the engine with `wrap_runner` at construction."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, call, callback=None):
        return self.inner(call, callback)

    def describe(self):
        return self.inner.describe()
