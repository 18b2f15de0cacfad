"""Who may enter: tenants and API keys, token buckets, concurrency caps, the circuit
breaker, and the decision that combines them.  Pure Python; its
:class:`~sluicegate.admission.decision.Rejection` objects become HTTP answers upstream."""
