"""`--role all`: the supervisor that runs conductor, store, prefill and decode as child processes."""
