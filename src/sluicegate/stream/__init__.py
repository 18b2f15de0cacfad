"""Per-request output: text assembly, stop strings, buffering toward the client."""
