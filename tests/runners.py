"""The tests' base for a pipeline runner around the engine's own (tests/serving.py's gated one, the browser tests'
held one); light, so the plugins can import it before anything loads Gradio."""


class RunnerWrapper:
    """A runner around another (the engine's pipeline runner), passing calls through: what tests subclass to hold,
    time or slow calls, handed to the engine with `wrap_runner` at construction."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, call, callback=None):
        return self.inner(call, callback)

    def describe(self):
        return self.inner.describe()
