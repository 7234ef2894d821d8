"""Structured output: a grammar (JSON schema, JSON object, regex or Lark) that every committed token obeys.

A :class:`Constraint` wraps an llguidance matcher (MIT; its Rust matcher reads the artifact's
`tokenizer.json`, no transformers or torch) compiled for one request. The decoding loop asks it, row by
row of a verify call, which tokens the grammar allows next (`allowed`), masks the target's logits with
that before choosing the row's token, and advances it only by what is committed (`commit`): rejected
proposals never enter the matcher, so nothing has to be rolled back. Proposals the grammar forbids are
cut before the target call (`valid_prefix`), and where the grammar admits one continuation only
(`forced`), its tokens can be offered as free proposals, verified by the target like any other.

The matcher never raises on a grammar error or a forbidden token: it enters an error state. Every step
checks it, and a request whose constraint fails ends with a DFlashError, never with unconstrained text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import DFlashError

# what `response_format` may be (OpenAI's shapes) and the extensions `grammar=` (Lark) and `regex=`
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# llguidance's JSON schema compiler options: OpenAI's strict mode ("additionalProperties": false where
# unset is not implied); whitespace kept compact so replies are as short as the model writes them
_JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": True}


def constraint_grammar(response_format: Any = None, grammar: str | None = None, regex: str | None = None) -> str | None:
    """The llguidance grammar text of a request's constraint options (at most one of them), or None.

    Args:
        response_format: OpenAI's `{"type": "text"}`, `{"type": "json_object"}` or
            `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
        grammar: a Lark grammar (llguidance's syntax; an extension).
        regex: a regular expression the whole reply matches (an extension).

    Raises:
        DFlashError: more than one given, a malformed `response_format` (the field is named).
    """
    given = [n for n, v in (("response_format", response_format), ("grammar", grammar), ("regex", regex)) if v is not None]
    if len(given) > 1:
        raise DFlashError(f"pass at most one of response_format, grammar and regex (got {', '.join(given)})")
    import llguidance

    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise DFlashError("grammar must be a non-empty Lark grammar string")
        return llguidance.grammar_from("lark", grammar)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise DFlashError("regex must be a non-empty regular expression string")
        return llguidance.grammar_from("regex", regex)
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMAT_TYPES:
        raise DFlashError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)} "
                          f"(got {response_format.get('type') if isinstance(response_format, dict) else response_format!r})")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise DFlashError('response_format.json_schema must be an object {"name": ..., "schema": {...}}')
    schema = dict(spec.get("schema") or {})
    if spec.get("strict") and schema.get("type") == "object":
        schema.setdefault("additionalProperties", False)
    return _json_grammar(schema)


def _json_grammar(schema: dict) -> str:
    import llguidance

    try:
        text = json.dumps({**schema, "x-guidance": _JSON_OPTIONS})
    except (TypeError, ValueError) as exc:
        raise DFlashError(f"response_format.json_schema.schema is not JSON: {exc}") from None
    return llguidance.grammar_from("json_schema", text)


class GrammarTokenizer:
    """The artifact's tokenizer as llguidance reads it: built once per Session (a second or so for a
    150k vocabulary), shared by every request's matcher.

    Raises:
        DFlashError: llguidance is not installed, or cannot read this tokenizer.

    Args:
        tokenizer_json: the artifact's `tokenizer.json`.
        vocab_size: the target's logits width (may exceed the tokenizer's own vocabulary).
        stop_ids: the ids that end a reply (the grammar's end of text is one of these).
    """

    def __init__(self, tokenizer_json: Path, vocab_size: int, stop_ids):
        try:
            import llguidance
        except ImportError:
            raise DFlashError("structured output needs llguidance: pip install 'dflash-export[structured]' "
                              "(or pip install llguidance)") from None
        self.vocab_size = int(vocab_size)
        try:
            self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=self.vocab_size,
                                                    eos_token=sorted(int(t) for t in stop_ids) or None)
        except Exception as exc:  # (llguidance raises ValueError for a tokenizer it cannot map to bytes)
            raise DFlashError(f"this artifact's tokenizer cannot drive output constraints (llguidance: {exc}); "
                              "structured output needs a byte-level BPE or SentencePiece tokenizer.json") from None


class Constraint:
    """One request's grammar state.

    Args:
        tokenizer: the session's :class:`GrammarTokenizer`.
        grammar: llguidance grammar text (:func:`constraint_grammar`).

    Raises:
        DFlashError: the grammar does not compile (llguidance's message).
    """

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer.tokenizer)
        if error:
            raise DFlashError(f"the constraint does not compile: {error}")
        self.matcher = llguidance.LLMatcher(tokenizer.tokenizer, grammar, log_level=0)
        self._check()
        self.vocab_size = tokenizer.vocab_size
        self.mask_seconds = 0.0  # time spent computing masks (what a user pays per constrained token)
        self.masks = 0

    def _check(self) -> None:
        if self.matcher.is_error():  # (llguidance's first line: the rest is its parser state, for its developers)
            raise DFlashError(f"the output constraint failed: {self.matcher.get_error().strip().splitlines()[0]}")

    def allowed(self) -> np.ndarray:
        """bool `[vocab_size]`: the tokens the grammar allows next (only stop ids once it is complete)."""
        import time

        t0 = time.perf_counter()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1
        if not allowed.any():
            raise DFlashError("the output constraint allows no token here (the grammar cannot be completed)")
        return allowed

    def commit(self, token: int) -> None:
        """Advance by one committed token. Raises DFlashError if the grammar forbids it."""
        if not self.matcher.consume_token(int(token)):
            self._check()
            raise DFlashError(f"the output constraint rejected token {int(token)}")
        self._check()

    def valid_prefix(self, proposals) -> int:
        """How many of `proposals` (in order, from the current state) the grammar allows."""
        ids = [int(t) for t in proposals]
        return self.matcher.validate_tokens(ids) if ids else 0

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar admits as the only continuation here (at most `limit`): free proposals,
        which the target still verifies (a forced byte string may have another tokenization)."""
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]] if limit > 0 else []

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts nothing more but a stop token."""
        return self.matcher.is_stopped()
