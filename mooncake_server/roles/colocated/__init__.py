"""The colocated baseline process: one engine prefills and decodes, no store hop."""
