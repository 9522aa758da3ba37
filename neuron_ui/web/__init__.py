"""What the UI and the server both stand on: the one bridge to Gradio's internals, where files are kept and served
(the private folder, the image store, the uploads' budget), errors and progress as users read them, and who a
request is from. Above the engine, below both rooms that use it: the server imports nothing of the UI."""
