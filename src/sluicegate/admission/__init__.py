"""The front door: tenants, rate limits, concurrency caps, the circuit breaker, the bounded
fair queue and the job journal.  Pure Python; the api layer calls it and maps its
:class:`~sluicegate.admission.decision.Rejection` objects to HTTP responses."""
