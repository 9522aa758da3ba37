"""The HTTP server, the gate in front of Gradio's routes, MCP and /metrics; it imports nothing of neuron_ui.ui."""
