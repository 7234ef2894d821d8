"""Incremental detokenization and stop strings for streamed replies.

:class:`IncrementalText` turns committed ids into text deltas that never split a character and never
repeat text: it decodes a short window of ids twice (up to the last emitted id, and up to the newest)
and emits the difference once it no longer ends in U+FFFD (an unfinished UTF-8 sequence of a byte-level
BPE). Decoding a window rather than the whole reply keeps a step's cost constant; starting the window a
few ids back gives tokenizers that strip a leading space (SentencePiece's Metaspace) or merge bytes
across ids the same context in both decodes. With byte-level BPE (Qwen3, SmolLM2, Llama 3) the deltas
concatenate to `decode(all ids)`. A byte-fallback decoder (SentencePiece models such as Llama 2) can
rewrite text already emitted: an invalid byte run decodes as one U+FFFD per byte only once the run is
complete. Emitted text is never taken back: the stream keeps it and goes on after it, so its text can
then differ from `decode(all ids)` inside such a run (and `generate` returns the stream's text).

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
        return self._delta(final=False)

    def finish(self) -> str:
        """The rest of the text once no ids will follow (an unfinished character is emitted as decoded)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.emitted == len(self.ids):
            return ""
        start = max(self.emitted - _WINDOW, 0)
        before = self.decode(self.ids[start:self.emitted]) if self.emitted > start else ""
        after = self.decode(self.ids[start:])
        if not final and after.endswith(_REPLACEMENT):
            return ""  # an unfinished character: wait for its next bytes
        if after.startswith(before):
            delta = after[len(before):]
        else:  # the decoder rewrote emitted text (byte fallback): keep it, continue after its length
            delta = after[len(before):] if len(after) > len(before) else ""
        if not delta and not final:
            return ""  # nothing new yet (e.g. a skipped special token): the window keeps these ids
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
