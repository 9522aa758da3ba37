"""What the process is told (flags, env vars, presets) and what it runs on (device, torchrun, cache folders)."""
