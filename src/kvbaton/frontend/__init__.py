"""The OpenAI-compatible HTTP frontend (steps S1, S2 and S9 of DESIGN.md)."""
