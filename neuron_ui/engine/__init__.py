"""The engine: one pipeline per process, compiled lazily per static shape, one image at a time."""
