"""Lightweight DFlash runtime: loads an artifact from `python -m dflash_export build` and runs
speculative decoding on onnxruntime (or TensorRT engines). Imports neither torch nor transformers.

Example:
    import runtime
    sess = runtime.load("artifacts/smollm2")
    res = sess.generate("Write a haiku about rain.", chat=True, max_new_tokens=64)
    print(res.text, res.tau, res.tokens_per_s)
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from runtime.errors import DFlashError
from runtime.session import GenerationResult, Session

__all__ = ["load", "generate", "Session", "GenerationResult", "DFlashError"]


def load(artifact_dir: str | Path, backend: str = "ort", threads: int | None = None, keep_logits: bool = False,
         int4_accuracy_level: int | None = None) -> Session:
    """Load an artifact directory into a reusable :class:`Session` (buffers allocated once; use it
    as a context manager or call `close()` to free them). Arguments as :class:`Session`'s.

    Raises:
        DFlashError: missing/incomplete artifact, manifest of another version, unknown backend.
    """
    return Session(artifact_dir, backend=backend, threads=threads, keep_logits=keep_logits,
                   int4_accuracy_level=int4_accuracy_level)


def generate(
    artifact_dir: str | Path,
    prompt: str | Sequence[int],
    max_new_tokens: int = 128,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float = 0.0,
    block_size: int | None = None,
    chat: bool = False,
    backend: str = "ort",
    seed: int = 0,
    record_steps: bool = False,
    verify_len: int | str | None = None,
) -> GenerationResult:
    """One-off generation: `load(artifact_dir, backend).generate(...)`; see :meth:`Session.generate`.

    The session is closed afterwards (its device memory freed); load one Session to generate often."""
    with load(artifact_dir, backend=backend) as sess:
        return sess.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            block_size=block_size,
            chat=chat,
            seed=seed,
            record_steps=record_steps,
            verify_len=verify_len,
        )
