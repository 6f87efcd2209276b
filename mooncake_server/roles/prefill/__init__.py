"""The prefill process: prompt -> KV blocks in the store + first token; local prefix cache."""
