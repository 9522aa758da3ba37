"""The Gradio studio: blocks, handlers and words; gradio_bridge is the one place touching Gradio internals."""
