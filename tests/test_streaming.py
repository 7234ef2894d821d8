"""Streaming, multi-turn KV reuse, stop strings and top_k / top_p sampling (issue 14's runtime API).

KV reuse must not change greedy output: every reused request is compared with a fresh session.
top_k / top_p sampling is checked against the target's processed distribution with chi-square tests,
as plain temperature sampling is in test_decoding.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import runtime
import runtime_fixtures as rf
from runtime import DFlashError
from runtime.speculation.sampling import processed_distribution
from runtime.text.incremental import IncrementalText, StopStrings

# a template over the word-level test tokenizer: turns as "t3 <role word> content t4", then "t5"
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {% if m.role == 'system' %}t6{% elif m.role == 'user' %}t7{% else %}t8{% endif %} "
    "{{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen_rows(qwen) -> np.ndarray:
    return rf.token_rows(qwen.target_dir)


@pytest.fixture(scope="module")
def chat_art(qwen, tmp_path_factory):
    """The tiny qwen artifact with a chat template in its manifest."""
    art = tmp_path_factory.mktemp("chat") / "art"
    shutil.copytree(qwen.artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    m["chat_template"] = CHAT_TEMPLATE
    (art / "manifest.json").write_text(json.dumps(m))
    return art


def fresh(art, prompt, **kw):
    with runtime.load(art) as s:
        return s.generate(prompt, **kw)


# ---- incremental text ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_bpe():
    """A small byte-level BPE tokenizer (as SmolLM2's and Qwen3's) trained on mixed-script text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world, naïve café", "数据 流 模型 解码", "emoji 🚀🔥 done", "Ünïcödé ∑ ≠ ∞"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize("text", ["hello world 🚀🔥 数据流 done", "∑≠∞ café naïve", "🚀", " spaces   and\nlines\n"])
def test_incremental_text_is_utf8_safe_and_complete(byte_bpe, text):
    ids = byte_bpe.encode(text).ids
    decode = lambda ids: byte_bpe.decode(ids)  # noqa: E731
    stream = IncrementalText(decode)
    deltas = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(deltas) == decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    if not text.isascii():  # the case that matters: some id holds part of a character
        assert any("\ufffd" in byte_bpe.decode([i]) for i in ids)


def test_incremental_text_with_byte_fallback_never_loses_text():
    """SentencePiece-style byte fallback: an invalid byte run is rewritten as one U+FFFD per byte once
    complete. The stream keeps what it emitted and goes on: the text after the run is not lost."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, **{ch: 1 + i for i, ch in enumerate("▁abcdehlorw")}}
    vocab.update({f"<0x{b:02X}>": 20 + i for i, b in enumerate((0xC3, 0x99, 0x8B, 0xA9))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tail = tok.encode(" hello world").ids
    for ids in ([vocab["a"], 20, 21, 22] + tail, [vocab["a"], 20, 23] + tail):  # invalid run; valid "é"
        stream = IncrementalText(tok.decode)
        text = "".join(stream.push([i]) for i in ids) + stream.finish()
        assert text.endswith(" hello world") and text.startswith("a")
        if tok.decode(ids).count("\ufffd") == 0:
            assert text == tok.decode(ids) == "aé hello world"


def test_stop_strings_cut_exactly_and_hold_back():
    s = StopStrings(["END", "\n\n"])
    a = s.feed("abc E")
    assert a == "abc"  # " E" could begin "END": held back
    b, c = s.feed("N"), s.feed("Dxyz")
    assert a + b + c == "abc " and s.stopped
    assert s.feed("more") == "" and s.finish() == ""
    s = StopStrings(["END"])
    assert s.feed("aEN") == "a" and s.finish() == "EN"
    assert StopStrings([]).feed("anything") == "anything"


# ---- streaming ----------------------------------------------------------------------------------
def test_stream_concatenates_to_generate(chat_art):
    with runtime.load(chat_art) as sess:
        kw = dict(max_new_tokens=20, stop_token_ids=[], verify_len="all")
        ref = sess.generate("t5 t6 t7", **kw, reuse_prefix=False)
        chunks = list(sess.stream("t5 t6 t7", **kw, reuse_prefix=False))
        assert "".join(c.text for c in chunks) == ref.text
        assert [t for c in chunks for t in c.token_ids] == ref.output_ids
        assert len(chunks) > 2  # it streams: the first token, then one chunk per step


def test_stream_closed_from_another_thread_frees_the_session(qwen):
    import threading

    prompt = [1, 40, 33, 12, 90]
    with runtime.load(qwen.artifact) as sess:
        stream = sess.stream(prompt, max_new_tokens=40, stop_token_ids=[], block_size=1)
        first = next(stream)
        started, closed = threading.Event(), threading.Event()
        inner = sess.backend.run

        def run(graph, inputs, outputs):  # close from another thread while a step is inside a graph call
            started.set()
            closed.wait(5)
            inner(graph, inputs, outputs)

        sess.backend.run = run
        closer = threading.Thread(target=lambda: (started.wait(5), stream.close(), closed.set()))
        closer.start()
        rest = list(stream)
        closer.join()
        sess.backend.run = inner
        assert len(rest) == 1 and len(first.token_ids) == 1  # the step in flight finished, then it stopped
        assert stream.result is None
        res = sess.generate(prompt, max_new_tokens=8, stop_token_ids=[], block_size=1)  # not locked
        assert res.output_ids == fresh(qwen.artifact, prompt, max_new_tokens=8, stop_token_ids=[], block_size=1).output_ids


def test_stream_closed_early_keeps_the_session_usable(qwen):
    prompt = [1, 40, 33, 12, 90]
    with runtime.load(qwen.artifact) as sess:
        with sess.stream(prompt, max_new_tokens=30, stop_token_ids=[], verify_len="all") as st:
            got = [t for _, c in zip(range(3), st) for t in c.token_ids]
        assert st.result is None and len(got) >= 3
        with pytest.raises(DFlashError, match="still open in this thread"):
            with sess.stream(prompt, max_new_tokens=4, verify_len="all"):  # (not auto: measuring costs resets the cache)
                sess.generate(prompt, max_new_tokens=4, verify_len="all")
        res = sess.generate(prompt, max_new_tokens=30, stop_token_ids=[], verify_len="all")
        assert res.reused_tokens == len(prompt) - 1
        assert res.output_ids == fresh(qwen.artifact, prompt, max_new_tokens=30, stop_token_ids=[], verify_len="all").output_ids
        assert res.output_ids[: len(got)] == got


def test_stop_string_ends_the_reply(chat_art):
    with runtime.load(chat_art) as sess:
        full = sess.generate("t5 t6 t7", max_new_tokens=20, stop_token_ids=[], verify_len="all")
        words = full.text.split(" ")
        stop = " " + words[3]  # the fourth generated word, with its space
        cut = full.text[: full.text.index(stop)]
        res = sess.generate("t5 t6 t7", max_new_tokens=20, stop_token_ids=[], verify_len="all", stop=[stop, "never"])
        assert res.text == cut and res.finish_reason == "stop"
        assert res.output_ids == full.output_ids[: len(res.output_ids)]
        assert " ".join(f"t{i}" for i in res.output_ids) == cut + stop  # ends at the id completing it
        chunks = list(sess.stream("t5 t6 t7", max_new_tokens=20, stop_token_ids=[], verify_len="all", stop=stop))
        assert "".join(c.text for c in chunks) == cut


# ---- KV reuse -----------------------------------------------------------------------------------
def test_prefix_reuse_equals_fresh_sessions(qwen):
    """A follow-up that extends the last request, a shorter one, an edited earlier token and a prompt
    that differs in its first token: each reuses exactly the common prefix and equals a fresh session."""
    base = [(5 * i + 7) % 90 + 3 for i in range(24)]
    kw = dict(max_new_tokens=12, stop_token_ids=[], verify_len="all", record_steps=True)
    with runtime.load(qwen.artifact) as sess:
        first = sess.generate(base, **kw)
        follow = base + first.output_ids + [9, 10, 11]
        edited = list(follow)
        edited[10] = (edited[10] + 1) % 90 + 3
        cases = [  # (prompt, rows expected reused)
            (follow, len(base) + len(first.output_ids) - 1),  # the last reply token was never a cache row
            (base[:15], 14),
            (edited, 10),
            ([base[0] + 1] + base[1:], 0),
            (base, 0),  # after a first-token divergence nothing of `base` is left
            (base, len(base) - 1),  # the same prompt again: all but the last token
        ]
        for prompt, reused in cases:
            res = sess.generate(prompt, **kw)
            ref = fresh(qwen.artifact, prompt, **kw)
            assert res.reused_tokens == reused, prompt
            assert (res.output_ids, res.steps) == (ref.output_ids, ref.steps)
        assert sess.generate(base, **kw, reuse_prefix=False).reused_tokens == 0


def test_multi_turn_chat_reuses_the_conversation(chat_art):
    kw = dict(max_new_tokens=8, stop_token_ids=[], verify_len="all")
    with runtime.load(chat_art) as sess:
        msgs = [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t11 t12 t13"}]
        r1 = sess.chat(msgs, **kw)
        assert r1.prompt_tokens == len(sess.encode_messages(msgs)) and r1.reused_tokens == 0
        msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "t20"}]
        r2 = sess.chat(msgs, **kw)
        assert r2.reused_tokens >= len(sess.encode_messages(msgs[:2])) - 1  # system + first user turn at least
        assert r2.output_ids == fresh(chat_art, None, messages=msgs, **kw).output_ids
        chunks = list(sess.stream(messages=msgs, **kw))
        assert "".join(c.text for c in chunks) == r2.text


def test_chat_message_errors(chat_art, qwen):
    with runtime.load(chat_art) as sess:
        for bad, match in [
            ([], "non-empty list"),
            ([{"role": "robot", "content": "t9"}], "role must be one of"),
            ([{"role": "user", "content": 5}], "content must be a string"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
            ([{"role": "user", "content": "t9", "tool_calls": []}], "only assistant turns carry tool calls"),
            ([{"role": "user", "content": "t9", "audio": {}}], r"unsupported fields \['audio'\]"),
        ]:
            with pytest.raises(DFlashError, match=match):
                sess.chat(bad, max_new_tokens=2)
        with pytest.raises(DFlashError, match="exactly one"):
            sess.generate("t5", messages=[{"role": "user", "content": "t9"}])
        with pytest.raises(DFlashError, match="unknown generation option"):
            sess.generate("t5", frequency_penalty=0.5)
    with runtime.load(qwen.artifact) as sess, pytest.raises(DFlashError, match="no chat template"):
        sess.chat([{"role": "user", "content": "t9"}], max_new_tokens=2)


# ---- top_k / top_p ----------------------------------------------------------------------------
def test_processed_distribution_matches_its_definition():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32) * 3
    for t, k, p in [(0.7, 0, 0.9), (1.0, 50, 1.0), (1.3, 40, 0.5), (0.5, 0, 0.999), (1.0, 0, 0.2)]:
        ids, probs = processed_distribution(logits, t, k, p)
        full = rf.softmax(logits, t)
        order = np.argsort(-full, kind="stable")
        keep = order[:k] if k else order
        q = full[keep] / full[keep].sum()
        cum_before = np.cumsum(q) - q
        keep = keep[cum_before < p]  # nucleus: tokens whose more likely neighbours hold < p
        assert list(ids) == list(keep)
        np.testing.assert_allclose(probs, full[keep] / full[keep].sum(), rtol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6)])
def test_top_k_top_p_sampling_distribution(qwen, qwen_rows, top_k, top_p):
    """First token ~ the processed target distribution; the second, verified against an oracle
    proposal of its mode, is accepted iff the sample equals it, and also follows the processed
    conditional."""
    prompt, t, n_seeds = [5, 6, 7], 1.0, 600
    logits1 = rf.hf_next_logits(qwen.target_dir, prompt)
    ids1, q1 = processed_distribution(logits1, t, top_k, top_p)
    p1 = np.zeros(rf.VOCAB)
    p1[ids1] = q1
    assert 2 <= len(ids1) < rf.VOCAB // 2, "the processing must matter for the test to have power"
    a = int(ids1[0])
    ids2, q2 = processed_distribution(rf.hf_next_logits(qwen.target_dir, prompt + [a]), t, top_k, top_p)
    p2 = np.zeros(rf.VOCAB)
    p2[ids2] = q2
    mode2 = int(ids2[0])
    with runtime.load(qwen.artifact) as sess:
        rf.Oracle(sess, qwen_rows, len(prompt), lambda k, m: [mode2] * m)
        first, second = np.zeros(rf.VOCAB, int), np.zeros(rf.VOCAB, int)
        for seed in range(n_seeds):
            res = sess.generate(prompt, max_new_tokens=3, stop_token_ids=[], temperature=t, top_k=top_k, top_p=top_p,
                                seed=seed, block_size=4, record_steps=True, verify_len="all")
            x1, x2 = res.output_ids[:2]
            first[x1] += 1
            if res.steps[0]["proposed"]:  # speculation runs only when the sample was the greedy token
                assert res.steps[0]["proposed"] == [mode2] and res.steps[0]["accepted"] == int(x2 == mode2)
            if x1 == a:
                second[x2] += 1
        assert first[p1 == 0].sum() == 0 and second[p2 == 0].sum() == 0  # nothing outside the kept set
        for counts, p in ((first, p1), (second, p2)):
            ok, stat, thr = rf.chi_square_ok(counts, p)
            assert ok, f"chi-square {stat:.1f} > {thr:.1f}"
        # power: plain temperature sampling (nothing cut) is rejected
        assert not rf.chi_square_ok(first, rf.softmax(logits1, t))[0]
        # the same seeds give the same samples with plain decoding (block_size 1)
        for seed in range(0, n_seeds, 100):
            kw = dict(max_new_tokens=6, stop_token_ids=[], temperature=t, top_k=top_k, top_p=top_p, seed=seed)
            assert sess.generate(prompt, block_size=1, **kw).output_ids[:1] == \
                sess.generate(prompt, block_size=4, verify_len="all", **kw).output_ids[:1]


def test_a_seed_gives_one_reply_whatever_the_speculation(qwen):
    """Each output position samples with its own uniform, so the reply for a seed does not depend on the
    verify lengths, the block size, the adaptive policy's state or KV reuse."""
    prompt = [1, 40, 33, 12, 90]
    with runtime.load(qwen.artifact) as sess:
        for sampling in (dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=20)):
            kw = dict(max_new_tokens=24, stop_token_ids=[], seed=11, **sampling)
            plain = fresh(qwen.artifact, prompt, block_size=1, **kw).output_ids
            for extra in (dict(), dict(verify_len="all"), dict(verify_len=1), dict(block_size=3), dict(reuse_prefix=False), dict()):
                assert sess.generate(prompt, **kw, **extra).output_ids == plain, (sampling, extra)
        assert sess.generate(prompt, max_new_tokens=8, temperature=1e-40, stop_token_ids=[]).output_ids == \
            fresh(qwen.artifact, prompt, max_new_tokens=8, stop_token_ids=[], block_size=1).output_ids  # the T -> 0 limit


def test_top_k_1_is_greedy(qwen):
    prompt = [1, 40, 33, 12, 90]
    greedy = fresh(qwen.artifact, prompt, max_new_tokens=20, stop_token_ids=[], block_size=1)
    with runtime.load(qwen.artifact) as sess:
        for seed in range(3):
            res = sess.generate(prompt, max_new_tokens=20, stop_token_ids=[], temperature=1.0, top_k=1, seed=seed,
                                verify_len="all")
            assert res.output_ids == greedy.output_ids


def test_sampling_option_errors(qwen):
    with runtime.load(qwen.artifact) as sess:
        for kw, match in [
            (dict(top_p=0.0), "top_p must be in"),
            (dict(top_p=1.5), "top_p must be in"),
            (dict(top_k=-1), "top_k must be >= 0"),
            (dict(top_k=10_000, temperature=1.0), "exceeds the vocabulary"),
            (dict(temperature=float("nan")), "finite number"),
            (dict(stop=[""]), "non-empty string"),
            (dict(stop=5), "stop must be a string"),
            (dict(reuse_prefix="yes"), "true or false"),
        ]:
            with pytest.raises(DFlashError, match=match):
                sess.generate([5, 6], max_new_tokens=2, **kw)


def test_calls_split_to_the_engine_row_limit(qwen):
    """With engines whose profiles take 3 new rows on a non-empty cache, a reused prompt's new rows and
    the draft's catch-up are split into calls of <= 3 rows; output equals a fresh session's."""
    base = [(3 * i + 5) % 90 + 3 for i in range(10)]
    kw = dict(max_new_tokens=12, stop_token_ids=[], verify_len="all")
    with runtime.load(qwen.artifact) as sess:
        sess.backend.max_call_rows = lambda graph: 3
        calls = []
        run = sess.backend.run

        def record(graph, inputs, outputs):
            rows = inputs["input_ids" if graph == "target" else "context_hidden"].shape[0]
            calls.append((graph, rows, inputs["past_key_0"].shape[0]))
            run(graph, inputs, outputs)

        sess.backend.run = record
        first = sess.generate(base, **kw)
        longer = base + first.output_ids + [11, 12, 13, 14, 15, 16, 17]
        res = sess.generate(longer, **kw)
        assert res.reused_tokens == len(base) + len(first.output_ids) - 1
        assert res.output_ids == fresh(qwen.artifact, longer, **kw).output_ids
        assert all(rows <= 3 for graph, rows, past in calls if past > 0 and graph == "draft")
        assert all(rows <= 3 for graph, rows, past in calls if past > 0 and graph == "target")
        assert sum(1 for g, rows, past in calls if g == "target" and past > 0 and rows > 1) >= 2  # split prefill


def test_text_that_is_not_unicode_is_refused(chat_art):
    with runtime.load(chat_art) as sess:
        with pytest.raises(DFlashError, match="lone surrogate"):
            sess.generate("t5 \ud800 t6", max_new_tokens=2)
        with pytest.raises(DFlashError, match="lone surrogate"):
            sess.chat([{"role": "user", "content": "t9 \udfff"}], max_new_tokens=2)
