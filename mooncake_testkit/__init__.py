"""Test and benchmark tooling: start mooncake-server process trees (not part of the runtime package)."""
