"""The OpenAI-compatible HTTP frontend (docs/architecture.md, "A request's path")."""
