"""The conductor process: OpenAI API app, request path, moves, registry, scheduler, store index."""
