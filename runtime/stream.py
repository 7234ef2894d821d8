"""The handle `Session.stream` returns: an iterator of committed chunks that can be closed early."""

from __future__ import annotations

import threading
from typing import Iterator

from runtime.loop import DecodeLoop
from runtime.results import GenerationResult, StreamChunk


class GenerationStream:
    """The chunks of one generation as they are committed (see :meth:`Session.stream`).

    Iterate it once; `result` is the :class:`GenerationResult` after the last chunk (None if it was
    closed early). `close()` (or leaving a `with` block) stops the generation and frees the session for
    the next call; called from another thread while a chunk is being computed, it takes effect when
    that step ends (the chunk is still returned, the next iteration stops).
    """

    def __init__(self, loop: DecodeLoop, lock: threading.Lock):
        self._loop, self._lock = loop, lock
        self._chunks = loop.run()
        self._state = threading.Lock()  # guards the three flags below
        self._open, self._running, self._close_requested = True, False, False

    @property
    def result(self) -> GenerationResult | None:
        return self._loop.result

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        with self._state:
            if not self._open:
                raise StopIteration
            requested = self._close_requested
            self._running = not requested
        if requested:
            self.close()
            raise StopIteration
        try:
            chunk = next(self._chunks)
        except BaseException:
            with self._state:
                self._running = False
            self.close()
            raise
        with self._state:
            self._running = False
            requested = self._close_requested
        if requested:  # asked from another thread during this step
            self.close()
        return chunk

    def close(self) -> None:
        """Stop the generation (if still running) and release the session."""
        with self._state:
            if not self._open:
                return
            if self._running:  # another thread is inside the step: it closes when the step ends
                self._close_requested = True
                return
            self._open = False
        try:
            self._chunks.close()
        finally:
            self._lock.release()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
