"""What crosses the seam between the UI and whatever makes images: plain values, no torch."""
