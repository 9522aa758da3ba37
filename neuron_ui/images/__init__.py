"""Where images are handled below the seam: the bounded decoder every input image passes through, and the fast
PNG encoder every result is written with; plain PIL and numpy, no torch."""
