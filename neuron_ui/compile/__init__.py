"""How transformer graphs are compiled, and what the compile caches did for each call."""
