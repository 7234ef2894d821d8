"""Incremental detokenization and stop strings for streamed replies.

:class:`IncrementalText` turns committed ids into text deltas that never split a character and never
repeat text: it decodes a short window of ids twice (up to the last emitted id, and up to the newest)
and emits the difference once it no longer ends in U+FFFD (an unfinished UTF-8 sequence of a byte-level
BPE). Decoding a window rather than the whole reply keeps a step's cost constant; starting the window a
few ids back gives tokenizers that strip a leading space (SentencePiece's Metaspace) or merge bytes
across ids the same context in both decodes. The deltas concatenate to `decode(all ids)`; `finish()`
checks that and repairs the tail if a tokenizer's decoding was not local.

:class:`StopStrings` cuts the text before the first stop string, holding back the few characters that
could still begin one.
"""

from __future__ import annotations

from typing import Callable, Sequence

_REPLACEMENT = "\ufffd"
# ids of context before the emitted position that each decode starts from
_WINDOW = 4


class IncrementalText:
    """Text deltas of a growing id sequence.

    Args:
        decode: ids -> text (special tokens skipped), e.g. `ChatTokenizer.decode`.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.emitted = 0  # ids whose text has been emitted
        self.text = ""  # everything emitted so far

    def push(self, ids: Sequence[int]) -> str:
        """Append ids; returns the new complete text (possibly "")."""
        self.ids.extend(int(i) for i in ids)
        start = max(self.emitted - _WINDOW, 0)
        before = self.decode(self.ids[start:self.emitted]) if self.emitted > start else ""
        after = self.decode(self.ids[start:])
        if after.endswith(_REPLACEMENT) or len(after) <= len(before) or not after.startswith(before):
            return ""  # an unfinished character (or nothing new yet): wait for more ids
        delta = after[len(before):]
        self.emitted = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text once no ids will follow (an unfinished character is emitted as decoded)."""
        full = self.decode(self.ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # not reached with byte-level BPE or SentencePiece tokenizers; keep the stream's text
            delta = ""
        self.emitted = len(self.ids)
        self.text += delta
        return delta


class StopStrings:
    """Finds the first stop string in streamed text.

    Args:
        stops: the stop strings (may be empty).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""  # text received but not yet released
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; returns what is safe to emit. After a stop string is found (`stopped`), returns
        the text before it and nothing more."""
        if self.stopped:
            return ""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = len(self.pending) - self.hold if self.hold else len(self.pending)
        keep = max(keep, 0)
        out, self.pending = self.pending[:keep], self.pending[keep:]
        return out

    def finish(self) -> str:
        """The held-back text once the reply ended without a stop string."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
