"""Output constraints, log-probabilities and forced tool calls per slot in the BatchEngine: several
constrained streams decoding together (verifying draft, lookup and grammar proposals in shared calls)
each equal the one-sequence Session's reply, greedy and seeded, and follow their grammar. On the tiny
batched pair (`test_batching.art`) given a byte-level tokenizer of its 96 ids, so llguidance can read it."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from test_batching import art  # noqa: F401 (a fixture)
from tolerances import assert_fp32_close

import runtime
from runtime.batching import BatchEngine

pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow  # a copy of the batched build with its own engine runs (`make test`)

PROMPTS = [[5, 6, 7], [10, 11, 12, 13], [40, 41], [70, 3, 9, 22, 31], [15, 16, 17], [60, 61, 62]]
REQUESTS = [
    dict(regex="[a-c]{3,12}"),
    dict(grammar='start: "x" ("y" | "z")+ "."'),
    dict(response_format={"type": "json_object"}, max_new_tokens=20),
    dict(regex="[0-9]{2,10}", temperature=0.8, seed=3),
    dict(regex="(ab|cd)+!", logprobs=True, top_logprobs=3, verify_len=3),
    dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"n": {"enum": ["aa", "bb"]}}, "required": ["n"], "additionalProperties": False}}},
        max_new_tokens=20, temperature=0.7, seed=9),
]


@pytest.fixture(scope="module")
def constrained_art(art, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """`art` with a byte-level BPE tokenizer: id i < 95 is the byte 32 + i (printable ASCII), 95 ends."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    out = tmp_path_factory.mktemp("constrained") / "artifact"
    shutil.copytree(art, out)
    to_char = {b: ch for b, ch in zip(sorted(range(256)), _byte_chars())}
    tok = Tokenizer(models.BPE(vocab={to_char[32 + i]: i for i in range(95)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<end>"])
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stop_token_ids"] = [95]
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _byte_chars() -> list[str]:
    """ByteLevel's printable stand-in of each byte 0..255 (GPT-2's table)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _pattern(kw) -> re.Pattern | None:
    return re.compile(kw["regex"]) if "regex" in kw else None


def test_constrained_streams_equal_their_session_replies(constrained_art):
    """Six constrained requests (regex, Lark, json_object, json_schema; greedy and seeded; one with
    log-probabilities and a fixed verify length) stream together in a 4-slot engine, joining and leaving:
    each reply equals the Session's, follows its grammar and ends where the grammar is complete."""
    kws = [{"max_new_tokens": 16, **kw} for kw in REQUESTS]
    with runtime.load(constrained_art) as sess:
        want = [sess.generate(p, **kw) for p, kw in zip(PROMPTS, kws)]
    with BatchEngine(constrained_art, max_batch=4) as engine:
        handles = [engine.stream(p, **kw) for p, kw in zip(PROMPTS, kws)]
        for h in handles:
            for _ in h:
                pass
        got = [h.result for h in handles]
    for kw, g, w in zip(kws, got, want):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason, kw
        assert g.text == w.text
        if _pattern(kw) is not None and g.finish_reason == "stop":
            assert _pattern(kw).fullmatch(g.text), (kw, g.text)
        if "response_format" in kw and g.finish_reason == "stop":
            assert isinstance(json.loads(g.text), dict)
    lp_got, lp_want = got[4].logprobs, want[4].logprobs
    assert [e["token_id"] for e in lp_got] == [e["token_id"] for e in lp_want] == got[4].output_ids
    # (the batched graph and the one-sequence graph are different graphs: their rows agree to fp32 rounding)
    assert_fp32_close(np.array([e["logprob"] for e in lp_got]), np.array([e["logprob"] for e in lp_want]),
                      reduction=256, depth=4, what="batched log-probabilities")
    assert all(len(e["top"]) == 3 for e in lp_got)


def test_a_grammar_that_does_not_compile_is_refused_before_it_queues(constrained_art):
    from runtime.errors import DFlashError

    with BatchEngine(constrained_art, max_batch=2) as engine:
        with pytest.raises(DFlashError, match="does not compile"):
            engine.stream([5, 6], max_new_tokens=4, grammar="start: (")
        reply = engine.generate([[5, 6]], max_new_tokens=4, regex="[a-z]+")[0]  # (the engine keeps serving)
        assert reply.output_ids and re.fullmatch("[a-z]+", reply.text)
