"""app.py with one fault injected, for tests/test_parallel.py: on the rank named by FAIL_RANK, a pipeline
call with seed 13 raises, as a device error on one rank would. Not a test module."""

import os
import runpy
import sys
from pathlib import Path

from neuron_ui.model.runner import PipelineRunner

if os.environ.get("RANK") == os.environ.get("FAIL_RANK"):
    run = PipelineRunner.__call__

    def failing(self, call, callback=None):
        if call.seed == 13:
            raise RuntimeError("injected device fault")
        return run(self, call, callback)

    PipelineRunner.__call__ = failing

app = Path(__file__).resolve().parent.parent / "app.py"
sys.argv[0] = str(app)
runpy.run_path(str(app), run_name="__main__")
