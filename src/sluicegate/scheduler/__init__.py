"""Queue and scheduler: pure-Python bookkeeping, no torch import."""
