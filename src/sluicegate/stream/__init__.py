"""Per-request output to the client: resumable stream sessions and their replay logs,
SSE framing, and flow control (a slow reader pauses only its own sequence)."""
