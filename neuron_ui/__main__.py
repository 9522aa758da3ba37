"""`python -m neuron_ui`: the headless command (neuron_ui/cli.py)."""

import sys

from neuron_ui.cli import main

sys.exit(main())
