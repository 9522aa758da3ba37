"""The Gradio studio: blocks, handlers and words; Gradio's internals are read in neuron_ui/web's bridge, not here."""
