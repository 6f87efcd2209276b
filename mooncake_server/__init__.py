"""mooncake-server: KVCache-centric disaggregated LLM serving (the Mooncake architecture)."""
