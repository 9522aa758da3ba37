"""`python -m neuron_ui`: the headless command (neuron_ui/cli.py)."""

import gc
import sys

from neuron_ui.cli import main

code = main()
gc.freeze()  # as app.py does: the interpreter's exit need not collect the model and torch's objects (~1 s)
sys.exit(code)
