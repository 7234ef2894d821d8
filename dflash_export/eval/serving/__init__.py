"""Serving measurements: several clients through the server, and the batched engine in one process."""
