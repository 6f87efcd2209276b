"""What every instance process (prefill, decode, store) shares: registration, draining, heap, engine set-up."""
