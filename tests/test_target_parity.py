"""Target ONNX graph (onnxruntime, CPU, fp32) against the Hugging Face model on the same checkpoint.

Covers a tiny Qwen3 (head_dim != hidden / heads, GQA 4:2) with untied and tied embeddings and a tiny
Llama: prefill, then 1-, 3- and 16-token steps that feed the returned K/V rows back as the past (the
16-token step is 1 committed token + 15 draft proposals whose ids are forced through draft_hidden),
a prefill past position 200, greedy and sampled posteriors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tolerances import assert_fp32_close, max_abs_err
from runtime.graphs.tree import VerifyTree, chain_inputs, tree_inputs

# Graph and HF model differ by fp32 rounding (tests/tolerances.py): the tiny targets' longest reduction is
# the MLP's (2 x hidden 64), chained through 4 layers and the head.
ROUNDING = dict(reduction=128, depth=5)
KINDS = ["qwen3", "qwen3_tied", "llama"]


class Case:
    """One tiny target: HF model, export module, ONNX session (built once per kind per module)."""

    def __init__(self, tiny_target):
        import onnxruntime as ort
        import transformers

        self.t = tiny_target
        cls = transformers.Qwen3ForCausalLM if tiny_target.spec.family == "qwen3" else transformers.LlamaForCausalLM
        self.hf = cls.from_pretrained(tiny_target.hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.sess = ort.InferenceSession(str(tiny_target.onnx_path), opts, providers=["CPUExecutionProvider"])
        a = tiny_target.spec.arch
        self.layers, self.kv_heads, self.head_dim, self.d = a.num_layers, a.num_kv_heads, a.head_dim, a.hidden_size
        self.vocab = tiny_target.spec.vocab_size
        self.out_names = [o.name for o in self.sess.get_outputs()]

    def empty_past(self) -> list[np.ndarray]:
        return [np.zeros((0, self.kv_heads, self.head_dim), np.float32) for _ in range(2 * self.layers)]

    def run(self, ids, past, draft_hidden=None, temperature=0.0, uniform=None, tree=None) -> dict[str, np.ndarray]:
        draft_hidden = np.zeros((0, self.d), np.float32) if draft_hidden is None else draft_hidden
        n = draft_hidden.shape[0]
        uniform = np.full(n + 1, 0.5, np.float32) if uniform is None else np.asarray(uniform, np.float32)
        feed = {
            "input_ids": np.asarray(ids, np.int64),
            "draft_hidden": draft_hidden.astype(np.float32),
            "temperature": np.array([temperature], np.float32),
            "uniform": uniform,
            **(tree_inputs(tree) if tree is not None else chain_inputs(n)),
        }
        for i in range(self.layers):
            feed[f"past_key_{i}"] = past[2 * i]
            feed[f"past_value_{i}"] = past[2 * i + 1]
        return dict(zip(self.out_names, self.sess.run(None, feed)))

    def new_kv(self, out) -> list[np.ndarray]:
        return [out[f"{kind}_{i}"] for i in range(self.layers) for kind in ("key", "value")]

    def reference(self, seq) -> dict[str, np.ndarray]:
        """HF on the whole sequence (causal: row r depends only on tokens 0..r)."""
        with torch.no_grad():
            out = self.hf(torch.tensor([list(seq)]), output_hidden_states=True, use_cache=True)
        hs = out.hidden_states
        assert len(hs) == self.layers + 1
        cache = out.cache
        return {
            "logits": out.logits[0].float().numpy(),
            "taps": torch.cat([hs[L + 1][0] for L in self.t.taps], dim=-1).numpy(),
            "last_hidden": hs[-1][0].numpy(),
            "kv": [
                getattr(cache.layers[i], kind)[0].permute(1, 0, 2).numpy()
                for i in range(self.layers)
                for kind in ("keys", "values")
            ],
        }

    def head_weight(self) -> np.ndarray:
        return self.hf.get_output_embeddings().weight.detach().float().numpy()

    def embed_weight(self) -> np.ndarray:
        return self.hf.get_input_embeddings().weight.detach().float().numpy()


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny) -> Case:
    return Case(tiny.target(request.param))


def _close(got, want, what, atol=None):
    """Within fp32 rounding (`ROUNDING`), or exactly `atol` (0.0: ids and embeddings copied, not computed)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if atol is None:
        assert_fp32_close(got, want, what=what, **ROUNDING)
    else:
        err = max_abs_err(got, want)
        assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"


def _check_step(case: Case, out, ref, p: int, t: int, n: int, what: str):
    """Compare one call (past P, T inputs, N proposals) with the HF reference rows."""
    s = t + n
    _close(out["taps"], ref["taps"][p : p + s], f"{what} taps")
    # The last tap layer's feature is HF's last hidden state (post-final-norm).
    d = case.d
    last = case.t.taps.index(case.layers - 1)
    _close(out["taps"][:, last * d : (last + 1) * d], ref["last_hidden"][p : p + s], f"{what} last-layer tap")
    _close(out["logits"], ref["logits"][p + t - 1 : p + s], f"{what} logits")
    assert out["logits"].shape == (1 + n, case.vocab)
    # Greedy posterior: argmax of the (HF-matching) logits, and its embedding rows.
    np.testing.assert_array_equal(out["next_ids"], np.argmax(ref["logits"][p + t - 1 : p + s], axis=-1), what)
    np.testing.assert_array_equal(out["next_ids"], np.argmax(out["logits"], axis=-1), what)
    _close(out["next_embeddings"], case.embed_weight()[out["next_ids"]], f"{what} next_embeddings", atol=0.0)
    for j, (got, want) in enumerate(zip(case.new_kv(out), ref["kv"])):
        _close(got, want[p : p + s], f"{what} {'key' if j % 2 == 0 else 'value'}_{j // 2}")


def _forced_draft_hidden(case: Case, tokens) -> np.ndarray:
    """draft_hidden rows whose target-lm_head argmax is `tokens` (scaled LM-head rows)."""
    return 8.0 * case.head_weight()[np.asarray(tokens)]


def test_tap_layers_include_last_layer(case):
    assert case.layers - 1 in case.t.taps and 0 in case.t.taps
    assert case.t.spec.arch.head_dim != case.d // case.t.spec.arch.num_heads
    assert case.t.spec.arch.num_kv_heads < case.t.spec.arch.num_heads
    assert case.t.spec.tie_word_embeddings == (case.t.kind == "qwen3_tied")


def test_prefill_and_steps_match_hf(case):
    """Prefill 7, then steps of 1, 3 and 1 + 15 proposals, feeding the new K/V rows back as past."""
    rng = np.random.default_rng(123)
    prompt = rng.integers(0, case.vocab, 7).tolist()
    one = rng.integers(0, case.vocab, 1).tolist()
    three = rng.integers(0, case.vocab, 3).tolist()
    anchor = rng.integers(0, case.vocab, 1).tolist()
    chosen = rng.integers(0, case.vocab, 15).tolist()
    seq = prompt + one + three + anchor + chosen
    ref = case.reference(seq)

    past = case.empty_past()
    p = 0
    for what, ids, proposals in (
        ("prefill", prompt, None),
        ("1-token step", one, None),
        ("3-token step", three, None),
        ("16-token step", anchor, chosen),
    ):
        dh = None if proposals is None else _forced_draft_hidden(case, proposals)
        out = case.run(ids, past, draft_hidden=dh)
        n = 0 if proposals is None else len(proposals)
        if proposals is not None:
            np.testing.assert_array_equal(out["proposal_ids"], np.asarray(chosen), "proposal_ids")
        else:
            assert out["proposal_ids"].shape == (0,)
        assert out["taps"].shape == (len(ids) + n, len(case.t.taps) * case.d)
        _check_step(case, out, ref, p, len(ids), n, what)
        past = [np.concatenate([old, new], axis=0) for old, new in zip(past, case.new_kv(out))]
        p += len(ids) + n
    assert p == len(seq)
    # The accumulated cache equals HF's cache for the whole sequence.
    for got, want in zip(past, ref["kv"]):
        _close(got, want, "accumulated cache")


def test_positions_past_200(case):
    """The graph was exported with 3-token dummies; a 230-token prefill and a step at P=230 match HF."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, case.vocab, 230).tolist()
    anchor = rng.integers(0, case.vocab, 1).tolist()
    chosen = rng.integers(0, case.vocab, 4).tolist()
    ref = case.reference(prompt + anchor + chosen)
    out = case.run(prompt, case.empty_past())
    _check_step(case, out, ref, 0, len(prompt), 0, "230-token prefill")
    past = case.new_kv(out)
    out = case.run(anchor, past, draft_hidden=_forced_draft_hidden(case, chosen))
    np.testing.assert_array_equal(out["proposal_ids"], chosen)
    _check_step(case, out, ref, len(prompt), 1, len(chosen), "step at P=230")


def inverse_cdf_sample(logits: np.ndarray, temperature: float, u: np.ndarray) -> np.ndarray:
    """Reference sampler: smallest i with CDF_i > u under softmax(logits / T) (float64 numpy)."""
    z = logits.astype(np.float64) / temperature
    pr = np.exp(z - z.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    cdf = np.cumsum(pr, axis=-1)
    return np.array([int(np.searchsorted(c, x, side="right")) for c, x in zip(cdf, u)])


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_sampling_inverse_cdf(case, temperature):
    """temperature > 0: next_ids is the inverse-CDF sample of softmax(logits / T) at `uniform`."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, case.vocab, 9).tolist()
    anchor = rng.integers(0, case.vocab, 1).tolist()
    chosen = rng.integers(0, case.vocab, 15).tolist()
    ref = case.reference(prompt + anchor + chosen)
    out = case.run(prompt, case.empty_past())
    past = case.new_kv(out)
    dh = _forced_draft_hidden(case, chosen)
    rows = ref["logits"][len(prompt) :]  # the 16 verified rows, from HF

    # Pick u in the middle of the CDF interval of a non-argmax token with real mass (rank 1..3),
    # far from every boundary, so fp32 vs float64 rounding cannot move the sample.
    z = rows.astype(np.float64) / temperature
    pr = np.exp(z - z.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    cdf = np.cumsum(pr, axis=-1)
    want, u = [], []
    for r in range(rows.shape[0]):
        order = np.argsort(-pr[r])
        tok = next((int(i) for i in order[1 + r % 3 :] if pr[r, i] > 0.01), int(order[0]))
        lo = cdf[r, tok - 1] if tok > 0 else 0.0
        want.append(tok)
        u.append(lo + pr[r, tok] / 2)
    u = np.asarray(u, np.float32)
    want = np.asarray(want)
    np.testing.assert_array_equal(inverse_cdf_sample(rows, temperature, u), want)  # the reference itself

    out = case.run(anchor, past, draft_hidden=dh, temperature=temperature, uniform=u)
    np.testing.assert_array_equal(out["proposal_ids"], chosen)
    _close(out["logits"], rows, "logits")  # logits do not depend on the temperature
    np.testing.assert_array_equal(out["next_ids"], inverse_cdf_sample(out["logits"], temperature, u))
    np.testing.assert_array_equal(out["next_ids"], want)
    assert np.any(out["next_ids"] != np.argmax(rows, axis=-1)), "sampling never left the argmax"
    _close(out["next_embeddings"], case.embed_weight()[out["next_ids"]], "sampled next_embeddings", atol=0.0)

    # Extreme uniforms: u = 0 picks the first token with mass in the graph's fp32 softmax (at T = 0.001
    # most tokens underflow to probability 0, token 0 among them; `cdf < u` picked token 0), u close
    # to 1 stays inside the vocabulary.
    out = case.run(anchor, past, draft_hidden=dh, temperature=0.001, uniform=np.zeros(16, np.float32))
    p32 = torch.softmax(torch.from_numpy(out["logits"]) / 0.001, dim=-1).numpy()
    assert np.any(p32[:, 0] == 0.0), "token 0 keeps mass: the case cannot tell the two rules apart"
    np.testing.assert_array_equal(out["next_ids"], np.argmax(p32 > 0, axis=-1))
    out = case.run(anchor, past, draft_hidden=dh, temperature=temperature, uniform=np.full(16, 0.9999999, np.float32))
    assert np.all((out["next_ids"] >= 0) & (out["next_ids"] < case.vocab))
    # temperature 0 ignores the uniforms: greedy.
    out = case.run(anchor, past, draft_hidden=dh, temperature=0.0, uniform=u)
    np.testing.assert_array_equal(out["next_ids"], np.argmax(rows, axis=-1))
    # greedy without uniforms (U = 0): the sampling branch is skipped, the result is the same argmax
    out0 = case.run(anchor, past, draft_hidden=dh, temperature=0.0, uniform=np.zeros(0, np.float32))
    np.testing.assert_array_equal(out0["next_ids"], np.argmax(rows, axis=-1))
    np.testing.assert_array_equal(out0["proposal_ids"], chosen)
    _close(out0["next_embeddings"], out["next_embeddings"], "greedy next_embeddings without uniforms", atol=0.0)


def test_draft_vocab_restricts_proposals_only(tiny, tmp_path):
    """With a proposal vocabulary, proposals are the argmax over those head rows only; everything the
    target verifies (logits, next_ids, K/V) is unchanged, and no full copy of the head is stored."""
    import onnxruntime as ort

    from dflash_export.export.checks import check_graph
    from dflash_export.export.graphs import export_target
    from dflash_export.nn.layers import TargetForExport, load_weights

    t = tiny.target("qwen3_tied")
    vocab = list(range(1, t.spec.vocab_size, 3))
    module = TargetForExport(t.spec, t.taps, torch.float32, draft_vocab=vocab).eval()
    load_weights(module, t.state, "tiny")
    module.freeze_draft_head()
    export_target(module, tmp_path / "target.onnx")
    extra = check_graph(tmp_path / "target.onnx")["initializer_bytes"] - check_graph(t.onnx_path)["initializer_bytes"]
    # at most the ids plus their head rows (folded by the exporter or at load), never a second full table
    assert 0 < extra <= len(vocab) * (8 + 4 * t.spec.arch.hidden_size) + 64
    sess = ort.InferenceSession(str(tmp_path / "target.onnx"), providers=["CPUExecutionProvider"])
    base = Case(t)
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((12, t.spec.arch.hidden_size)).astype(np.float32)
    feed = {"input_ids": np.array([3, 9, 4], np.int64), "draft_hidden": hidden, "temperature": np.zeros(1, np.float32),
            "uniform": np.zeros(0, np.float32), **chain_inputs(len(hidden))}
    for i in range(base.layers):
        feed[f"past_key_{i}"] = feed[f"past_value_{i}"] = np.zeros((0, base.kv_heads, base.head_dim), np.float32)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    head = base.head_weight()
    sub = hidden.astype(np.float64) @ head[vocab].T.astype(np.float64)
    want = np.asarray(vocab)[np.argmax(sub, axis=-1)]
    np.testing.assert_array_equal(got["proposal_ids"], want)
    # a verify tree's nodes: row depth[i]'s rank[i]-th candidate within the proposal vocabulary
    tree = VerifyTree(2, 3)
    tree_got = dict(zip([o.name for o in sess.get_outputs()],
                        sess.run(None, {**feed, "draft_hidden": hidden[:tree.size], **tree_inputs(tree)})))
    ranked = np.argsort(-sub, axis=-1, kind="stable")
    np.testing.assert_array_equal(tree_got["proposal_ids"], np.asarray(vocab)[ranked[tree.depth, tree.rank]])
    assert set(got["proposal_ids"].tolist()) <= set(vocab)
    full = np.argmax(hidden.astype(np.float64) @ head.T.astype(np.float64), axis=-1)
    assert np.any(full != want), "the fixture should make the full-vocabulary argmax differ somewhere"
    # the full-vocabulary graph, made to propose the same ids, verifies them identically
    plain = base.run([3, 9, 4], base.empty_past(), draft_hidden=_forced_draft_hidden(base, want), uniform=np.zeros(0, np.float32))
    np.testing.assert_array_equal(plain["proposal_ids"], want)
    for name in ("next_ids", "logits", "taps", "key_0", "value_2"):
        _close(got[name], plain[name], f"draft_vocab {name}")


def test_verify_tree_rows_match_hf_on_their_own_paths(case):
    """A verify tree (a chain of 3 and 3 alternatives for the first position) in one call: each node's
    logits, taps and K/V rows equal HF's on the sequence that ends with that node's path, and the
    alternatives are the draft's 2nd to 4th candidates for block position 1."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, case.vocab, 9).tolist()
    anchor = rng.integers(0, case.vocab, 1).tolist()
    out = case.run(prompt, case.empty_past())
    past = case.new_kv(out)
    tree = VerifyTree(3, 3)
    hidden = rng.standard_normal((tree.size, case.d)).astype(np.float32)
    out = case.run(anchor, past, draft_hidden=hidden, tree=tree)
    scores = hidden.astype(np.float64) @ case.head_weight().T.astype(np.float64)
    ranked = np.argsort(-scores, axis=-1, kind="stable")
    np.testing.assert_array_equal(out["proposal_ids"], ranked[tree.depth, tree.rank])
    assert len(set(out["proposal_ids"][[0, 3, 4, 5]].tolist())) == 4  # four distinct first proposals
    p = len(prompt)
    for node in range(tree.size):
        path, i = [], node
        while i >= 0:
            path.insert(0, int(out["proposal_ids"][i]))
            i = tree.parents[i]
        ref = case.reference(prompt + anchor + path)
        row, pos = 1 + node, p + len(path)  # this node's output row and its sequence position
        _close(out["logits"][row], ref["logits"][pos], f"node {node} logits")
        _close(out["taps"][row], ref["taps"][pos], f"node {node} taps")
        for j, (got, want) in enumerate(zip(case.new_kv(out), ref["kv"])):
            _close(got[row], want[pos], f"node {node} {'key' if j % 2 == 0 else 'value'}_{j // 2}")
    ref = case.reference(prompt + anchor)  # the root row sees no proposal
    _close(out["logits"][0], ref["logits"][p], "root logits")
