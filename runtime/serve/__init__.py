"""The OpenAI-compatible HTTP server: request parsing, replies, the generation worker, running uvicorn."""
