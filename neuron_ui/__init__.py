"""neuron-ui: a Gradio studio for FLUX.2-klein on Trainium, CUDA or CPU, compiled once per static shape."""
