"""What a user asks for, above the engine seam: an image, an edit, a grid, an A/B, a warm-up; grids as jobs; saving
the results; and the one bridge from a blocking engine call to a stream. The doors only translate to it."""
