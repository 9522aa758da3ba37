"""The diffusers pipeline: loading it, the offline tiny model, one call of it, and sharding it."""
