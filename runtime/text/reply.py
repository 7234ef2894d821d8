"""A reply as it is committed: its ids, its text deltas and why it ended, cut at the first stop token or
stop string. The one-sequence loop (`runtime.loop`) and the batched engine (`runtime.batching`) both
build their replies with it."""

from __future__ import annotations

from typing import Callable, Sequence

from runtime.results import StreamChunk, cut_at_stop
from runtime.text.incremental import IncrementalText, StopStrings


class ReplyText:
    """The committed ids and text of one reply.

    Args:
        decode: ids -> text (the tokenizer's; None: ids only, `text` stays "").
        stop: stop strings (the reply ends before the first one).
        stop_ids: ids that end the reply once committed (the id is kept).

    Attributes:
        out: the committed ids; text: the text streamed so far; finish_reason: "stop" once a stop id or
        string was committed, else "length".
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: Sequence[str], stop_ids: set[int]):
        self.incremental = IncrementalText(decode) if decode is not None else None
        self.stops = StopStrings(stop)
        self.stop_ids = stop_ids
        self.out: list[int] = []
        self.text = ""
        self.finish_reason = "length"

    def commit(self, ids: list[int]) -> StreamChunk:
        """Add committed ids, cutting at a stop token or stop string; returns the chunk they make."""
        kept, stopped = cut_at_stop(ids, self.stop_ids)
        if self.incremental is None:
            self.out += kept
            if stopped:
                self.finish_reason = "stop"
            return StreamChunk("", kept)
        taken, text = [], ""
        for t in kept:  # one id at a time: a stop string ends the reply at the id that completes it
            taken.append(t)
            text += self.stops.feed(self.incremental.push([t]))
            if self.stops.stopped:
                stopped = True
                break
        self.out += taken
        self.text += text
        if stopped:
            self.finish_reason = "stop"
        return StreamChunk(text, taken)

    def finish(self) -> str:
        """The text held back until the end (an unfinished character, a possible stop string's start)."""
        if self.incremental is None:
            return ""
        tail = self.stops.feed(self.incremental.finish()) + self.stops.finish()
        self.text += tail
        return tail

    @property
    def has_text(self) -> bool:
        return self.incremental is not None
