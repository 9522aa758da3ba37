"""What is kept on disk: the manifest of compiled shapes, estimates from it, bundles, cache admin."""
