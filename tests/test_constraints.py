"""Structured output (`runtime.text.constraints`): replies that follow a JSON schema, a JSON object, a
regex or a Lark grammar, equal under every decoding policy to constrained plain decoding (greedy, and per
seed when sampling), proposals the grammar forbids never verified, forced tokens offered as proposals,
and bad constraints refused with one clear error. On the real pair (the constraint reads its tokenizer)."""

from __future__ import annotations

import json
import re

import pytest

from runtime.errors import DFlashError

pytestmark = pytest.mark.slow  # the real pair (SmolLM2 export, shared with the other real-model tests)
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]}, "minItems": 1,
                                       "maxItems": 3}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PROMPTS = ["Describe a programmer named Ada, 36, as JSON.", "Give me a JSON record for a young developer.",
           "Return the details of Linus, who writes C, as a JSON object."]


@pytest.fixture(scope="module")
def sess(smollm2_artifact):
    import runtime

    with runtime.load(smollm2_artifact) as s:
        yield s


def _chat(sess, prompt, max_new_tokens=72, **kw):
    return sess.generate(messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens, **kw)


def _grammar_walk(sess, opts, result):
    """Replay the recorded steps on a fresh matcher: every verified proposal was allowed by the grammar
    at its place (forbidden ones were cut before the target call), every committed token too."""
    from runtime.options import GenerationOptions

    constraint = sess.constraint(GenerationOptions(**opts))
    constraint.commit(result.output_ids[0])  # (the prefill's token)
    sources = set()
    for step in result.steps:
        assert constraint.valid_prefix(step["proposed"]) == len(step["proposed"]), step
        for t in step["committed"]:
            constraint.commit(t)
        sources.add(step["source"])
    return sources


def test_json_schema_replies_validate_and_equal_constrained_plain(sess):
    sources = set()
    for prompt in PROMPTS:
        plain = _chat(sess, prompt, response_format=SCHEMA_FORMAT, block_size=1)
        reply = json.loads(plain.text)
        jsonschema.validate(reply, PERSON)
        assert plain.finish_reason == "stop"
        for mode in (dict(), dict(verify_len="all"), dict(verify_len=3)):
            spec = _chat(sess, prompt, response_format=SCHEMA_FORMAT, record_steps=True, **mode)
            assert spec.output_ids == plain.output_ids, (prompt, mode)
            sources |= _grammar_walk(sess, dict(response_format=SCHEMA_FORMAT), spec)
    assert "grammar" in sources and "draft" in sources  # forced tokens and drafts both verified


def test_seeded_sampling_under_a_constraint_is_the_same_with_and_without_speculation(sess):
    for seed in (7,):
        kw = dict(response_format={"type": "json_object"}, temperature=0.9, seed=seed, max_new_tokens=40)
        plain = _chat(sess, PROMPTS[1], block_size=1, **kw)
        assert _chat(sess, PROMPTS[1], **kw).output_ids == plain.output_ids
        assert _chat(sess, PROMPTS[1], verify_len="all", top_p=0.9, **kw).output_ids == \
            _chat(sess, PROMPTS[1], block_size=1, top_p=0.9, **kw).output_ids
        if plain.finish_reason == "stop":
            assert isinstance(json.loads(plain.text), dict)


def test_regex_and_lark_grammars(sess):
    r = _chat(sess, "What year did the Apollo 11 landing happen?", regex=r"[12][0-9]{3}")
    assert re.fullmatch(r"[12][0-9]{3}", r.text) and r.finish_reason == "stop"
    lark = 'start: answer "."\nanswer: "yes" | "no"'
    for mode in (dict(block_size=1), dict()):
        r = _chat(sess, "Is the sky blue? Answer yes or no.", grammar=lark, **mode)
        assert r.text in ("yes.", "no."), r.text


def test_max_tokens_inside_a_value_ends_with_length(sess):
    r = _chat(sess, PROMPTS[0], response_format=SCHEMA_FORMAT, max_new_tokens=5)
    assert r.finish_reason == "length" and len(r.output_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


@pytest.mark.parametrize("kw, match", [
    (dict(response_format={"type": "xml"}), "response_format.type must be one of text, json_object, json_schema"),
    (dict(response_format="json"), "response_format must be an object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}),
     "the constraint does not compile"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": []}}), "response_format.json_schema must be an object"),
    (dict(grammar="start: (", regex="a"), "pass at most one of response_format, grammar and regex"),
    (dict(grammar="start: ("), "the constraint does not compile"),
    (dict(regex="(unclosed"), "the constraint does not compile"),
    (dict(grammar=7), "grammar must be a string"),
])
def test_bad_constraints_get_one_clear_error_and_the_session_keeps_working(sess, kw, match):
    with pytest.raises(DFlashError, match=re.escape(match)):
        _chat(sess, "Hi", **kw)
    assert _chat(sess, "Say hi.", max_new_tokens=4).output_ids  # nothing held: the next request runs


def test_the_openai_client_gets_schema_replies_equal_to_plain(smollm2_artifact):
    """Through `runtime serve` and the openai client: a json_schema reply validates and equals the
    constrained plain (`block_size` 1) reply; json_object parses; a schema that does not compile is a 400
    naming response_format, and the server keeps answering."""
    openai = pytest.importorskip("openai")
    from serve_fixtures import make_client

    import runtime
    from runtime.serve.app import create_app
    from runtime.serve.run import ServerThread

    msgs = [{"role": "user", "content": PROMPTS[0]}]
    with runtime.load(smollm2_artifact) as sess, ServerThread(create_app(sess)) as srv:
        c = make_client(srv)
        kw = dict(model=c.models.list().data[0].id, messages=msgs, temperature=0, max_tokens=72)
        got = c.chat.completions.create(response_format=SCHEMA_FORMAT, **kw)
        plain = c.chat.completions.create(response_format=SCHEMA_FORMAT, extra_body={"block_size": 1}, **kw)
        jsonschema.validate(json.loads(got.choices[0].message.content), PERSON)
        assert got.choices[0].message.content == plain.choices[0].message.content
        assert got.choices[0].finish_reason == "stop"
        obj = c.chat.completions.create(response_format={"type": "json_object"}, **kw)
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(response_format=bad, **kw)
        assert err.value.body["param"] == "response_format" and "does not compile" in err.value.body["message"]
        assert c.chat.completions.create(**kw).choices[0].message.content  # still serving


def test_logprobs_match_a_pytorch_fp32_forward_and_do_not_depend_on_speculation(sess):
    """Each committed token's log-probability (and its row's top 5) equals a teacher-forced fp32 PyTorch
    forward of the target on the same ids within 2e-3; speculative and plain decoding report the same
    values (the same rows, bit for bit); under a constraint they stay the target's raw distribution."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sess.manifest["sources"]["target"]["path"], dtype=torch.float32).eval()
    prompt = sess.encode("Write a haiku about the sea.", chat=True)
    for kw in (dict(), dict(response_format={"type": "json_object"})):
        plain = sess.generate(prompt, max_new_tokens=24, block_size=1, logprobs=True, top_logprobs=5, **kw)
        spec = sess.generate(prompt, max_new_tokens=24, verify_len="all", logprobs=True, top_logprobs=5, **kw)
        assert spec.output_ids == plain.output_ids and spec.logprobs == plain.logprobs
        ids = prompt + plain.output_ids
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0, len(prompt) - 1: -1].double(), dim=-1)
        assert len(plain.logprobs) == len(plain.output_ids)
        for row, (e, t) in enumerate(zip(plain.logprobs, plain.output_ids)):
            assert e["token_id"] == t and abs(e["logprob"] - float(want[row, t])) <= 2e-3
            for i, lp in e["top"]:
                assert abs(lp - float(want[row, i])) <= 2e-3
