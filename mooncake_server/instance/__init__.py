"""What every instance process (prefill, decode, store, colocated) shares: the app skeleton
(lifespan, /health, /metrics), registration, draining, heap, engine set-up."""
