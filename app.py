"""neuron-ui: a Gradio studio for FLUX.2-klein on AWS Trainium, CUDA or CPU; starts like a Hugging Face Space.

    python app.py                                        # klein-4B if cached or reachable, else the tiny model
    python app.py --model black-forest-labs/FLUX.2-klein-4B --resolutions 1024x1024,1344x768
    python app.py --replicas 2                           # engine replicas on a local Ray Serve, routed by shape
    NEURON_UI_AUTH=user:secret python app.py --host 0.0.0.0 --port 7860 --max-queue 8
    torchrun --nproc_per_node=8 app.py --model black-forest-labs/FLUX.2-klein-4B   # tensor-parallel on trn

Flags and NEURON_UI_* / GRADIO_SERVER_* variables: docs/configuration.md. Start-up itself: neuron_ui/main.py.
"""

from neuron_ui.main import main

if __name__ == "__main__":
    main()
