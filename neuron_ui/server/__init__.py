"""The HTTP server, the gate in front of Gradio's routes, and /metrics."""
