"""The global store index the conductor keeps: which node holds which block, placement, hot copies."""
