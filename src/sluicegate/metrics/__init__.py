"""Prometheus metrics, the sliding-window summaries behind /v1/stats."""
