"""Sluicegate: an OpenAI-compatible streaming LLM server with backpressure end to end."""

from __future__ import annotations

__version__ = "0.1.0"
