"""Serving several generations at once on the batched target graph (`build --batched`):
:class:`BatchEngine` (continuous batching, thread-safe, streaming handles), its slot bookkeeping and
graph calls."""

from runtime.batching.engine import BatchedGeneration, BatchEngine

__all__ = ["BatchEngine", "BatchedGeneration"]
