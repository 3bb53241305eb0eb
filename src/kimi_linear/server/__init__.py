"""OpenAI-compatible HTTP server over the serving engine (issue 6)."""
