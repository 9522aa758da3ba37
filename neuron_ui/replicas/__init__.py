"""Engine replicas on Ray Serve: the only package that imports Ray."""
