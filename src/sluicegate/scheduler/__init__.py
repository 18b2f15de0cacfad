"""Continuous batching: pure-Python bookkeeping of sequences, KV capacity and pauses; no torch."""
