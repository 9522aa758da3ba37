import sys

from neuron_ui.cli import main

sys.exit(main())
