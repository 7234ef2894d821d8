"""DFlash 2 drafts (`DFlash2DraftModel`): a tiny draft in the released format, built with a tiny Qwen3
target and a tiny Qwen3.5 hybrid, against a from-scratch port of the official reference's loop.

The reference here is written from z-lab/dflash `model.py` (commit 10129599): `dflash_generate` at
T = 0 (draft the block, prefix match, bonus), `DFlash2DraftModel` (grouped dynamic convolutions around
each sublayer, bidirectional sliding attention over context + block) and `CandidateSelector.select`
(top-k of the target's LM head, walk from the anchor, argmax). It runs in float64 without caches: every
step recomputes the target over the whole sequence and the draft over the whole context.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import runtime_fixtures as rf
import tiny_models
import torch
from test_trt_backend_double import GPU, FakeTensorRT, doubles  # noqa: F401 - `doubles` is a fixture

import runtime
from dflash_export.build import BuildOptions, build
from runtime.errors import DFlashError

BLOCK = 8
F64 = torch.float64


# ---- the reference (float64, no cache) ---------------------------------------------------------
def _rms(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _convolve(x, dynamic, base, group):
    """The grouped dynamic convolution: x `[B, d]`, dynamic `[B, K, G]`, base `[K, d]`; tap t reads the
    row t back (zero before the block's first row)."""
    b, d = x.shape
    k = base.shape[0]
    parts = x.view(b, d // group, group)
    out = torch.zeros_like(parts)
    for t in range(k):
        shifted = torch.nn.functional.pad(parts, (0, 0, 0, 0, t, 0))[:b]
        out = out + base[t].view(d // group, group) * shifted
        out = out + dynamic[:, t, :, None] * shifted
    return out.view(b, d)


class Reference:
    """The DFlash 2 reference for one draft checkpoint and one HF target."""

    def __init__(self, draft_dir: Path, hf):
        from safetensors.torch import load_file

        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.dcfg = {**self.cfg, **self.cfg["dflash_config"]}  # dflash_config first, else the top level
        self.w = {k: v.to(F64) for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        self.hf = hf
        self.head = hf.get_output_embeddings().weight.detach().to(F64)
        self.embed = hf.get_input_embeddings().weight.detach().to(F64)

    def target(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits `[T, V]`, tap features `[T, k * d]`) of the whole sequence."""
        with torch.no_grad():
            out = self.hf(torch.tensor([ids]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i + 1][0] for i in self.dcfg["target_layer_ids"]], dim=-1)
        return out.logits[0].to(F64), taps.to(F64)

    def draft_hidden(self, context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """norm(h) of block positions 1..B-1 for context features `[C, k * d]` at positions 0..C-1 and
        block embeddings `[B, d]` at C..C+B-1."""
        cfg, w = self.cfg, self.w
        eps, heads, kv_heads, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        k_taps, groups = self.dcfg["conv_kernel_size"], self.dcfg["conv_group_size"]
        theta = cfg["rope_parameters"]["rope_theta"]
        ctx = _rms(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        h = block * self.dcfg.get("input_embedding_scale", 1.0)
        c, b = ctx.shape[0], h.shape[0]
        pos = torch.arange(c + b)
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        ang = (pos.float()[:, None] * inv[None, :]).to(F64)
        cos, sin = (torch.cat([t, t], dim=-1)[:, None, :] for t in (ang.cos(), ang.sin()))

        def rope(x, rows):
            return x * cos[rows] + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1) * sin[rows]

        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            causal = cfg["layer_types"][i] == "sliding_attention" if cfg.get("is_causal") is None else cfg["is_causal"]
            diff = pos[c:, None] - pos[None, :]
            visible = (diff >= 0) if causal else torch.ones_like(diff, dtype=torch.bool)
            if cfg["layer_types"][i] == "sliding_attention":
                visible &= (diff < cfg["sliding_window"]) & (causal | (-diff < cfg["sliding_window"]))
            for sub in ("attention", "mlp"):
                conv = p + ("attention_conv." if sub == "attention" else "mlp_conv.")
                norm = p + ("input_layernorm.weight" if sub == "attention" else "post_attention_layernorm.weight")
                x = _rms(h, w[norm], eps)
                dynamic = (x @ w[conv + "kernel_projection.weight"].T).view(b, 2, k_taps, -1)
                x = _convolve(x, dynamic[:, 0], w[conv + "base_kernel"][0], groups)
                if sub == "attention":
                    q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(b, heads, hd), w[p + "self_attn.q_norm.weight"], eps)
                    kin = torch.cat([ctx, x])
                    k = _rms((kin @ w[p + "self_attn.k_proj.weight"].T).view(c + b, kv_heads, hd),
                             w[p + "self_attn.k_norm.weight"], eps)
                    v = (kin @ w[p + "self_attn.v_proj.weight"].T).view(c + b, kv_heads, hd)
                    q, k = rope(q, pos[c:]), rope(k, pos)
                    rep = heads // kv_heads
                    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / math.sqrt(hd)
                    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
                    y = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(rep, 1)).reshape(b, heads * hd)
                    y = y @ w[p + "self_attn.o_proj.weight"].T
                else:
                    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
                    y = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
                h = h + _convolve(y, dynamic[:, 1], w[conv + "base_kernel"][1], groups)
        return _rms(h, w["norm.weight"], eps)[1:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on draft rows, times output_multiplier, soft-capped where set."""
        logits = hidden @ self.head.T * self.dcfg.get("output_multiplier", 1.0)
        cap = self.dcfg.get("final_logit_softcapping")
        return torch.tanh(logits / cap) * cap if cap is not None and cap > 0 else logits

    def select(self, hidden: torch.Tensor, anchor: int) -> list[int]:
        """The selector's argmax walk over the LM head's top-k candidates of each row."""
        unary, candidates = torch.topk(self.logits(hidden), self.dcfg["selector_top_k"], dim=-1, sorted=False)
        projected = hidden @ self.w["candidate_selector.hidden_projection.weight"].T
        before, after = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        path, previous = [], anchor
        for j in range(hidden.shape[0]):
            scores = unary[j] + (before[previous] * projected[j] * after[candidates[j]]).sum(-1)
            previous = int(candidates[j, int(torch.argmax(scores))])
            path.append(previous)
        return path

    def select_sampled(self, hidden: torch.Tensor, anchor: int, temperature: float, gen: torch.Generator):
        """The selector at T > 0: each position samples softmax(scores / T) over its candidates.
        Returns (path, candidates `[N, k]`, q `[N, k]`)."""
        unary, candidates = torch.topk(self.logits(hidden), self.dcfg["selector_top_k"], dim=-1, sorted=False)
        projected = hidden @ self.w["candidate_selector.hidden_projection.weight"].T
        before, after = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        path, qs, previous = [], [], anchor
        for j in range(hidden.shape[0]):
            q = torch.softmax((unary[j] + (before[previous] * projected[j] * after[candidates[j]]).sum(-1)) / temperature, -1)
            previous = int(candidates[j, int(torch.multinomial(q, 1, generator=gen))])
            path.append(previous)
            qs.append(q)
        return path, candidates, torch.stack(qs)

    def sampled_acceptance(self, prompt: list[int], max_new: int, temperature: float, seed: int) -> list[int]:
        """`dflash_generate` at T > 0 (the reference's rule: the selector samples its path, the target
        accepts each proposal with min(1, p / q), the residual max(p - q, 0) gives the next token).
        Returns the accepted proposals per full-block step."""
        gen = torch.Generator().manual_seed(seed)
        block, mask = self.dcfg["block_size"], self.dcfg["mask_token_id"]
        out = list(prompt)
        out.append(int(torch.multinomial(torch.softmax(self.target(out)[0][-1] / temperature, -1), 1, generator=gen)))
        start, end, accepted_per_step = len(prompt), len(prompt) + max_new, []
        while start + block < end:
            _, taps = self.target(out[:start])
            hidden = self.draft_hidden(taps, self.embed[[out[start]] + [mask] * (block - 1)])
            path, candidates, q = self.select_sampled(hidden, out[start], temperature, gen)
            p = torch.softmax(self.target(out[:start + 1] + path)[0][start:] / temperature, -1)
            accepted = 0
            while accepted < block - 1:
                j, token = accepted, path[accepted]
                q_token = float(q[j][candidates[j] == token].sum())
                if float(torch.rand((), generator=gen, dtype=F64)) * q_token >= float(p[j, token]):
                    break
                accepted += 1
            if accepted == block - 1:
                bonus = int(torch.multinomial(p[-1], 1, generator=gen))
            else:
                residual = p[accepted].clone()
                residual.scatter_add_(0, candidates[accepted], -q[accepted])
                residual = residual.clamp_min(0)
                residual = residual / residual.sum() if float(residual.sum()) > 0 else p[accepted]
                bonus = int(torch.multinomial(residual, 1, generator=gen))
            accepted_per_step.append(accepted)
            out = out[: start + 1] + path[:accepted] + [bonus]
            start += accepted + 1
        return accepted_per_step

    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], list[tuple[list[int], int]]]:
        """`dflash_generate` at T = 0 without stop tokens: (new ids, per full-block step (proposals, accepted))."""
        block, mask = self.dcfg["block_size"], self.dcfg["mask_token_id"]
        out = list(prompt)
        logits, _ = self.target(out)
        out.append(int(logits[-1].argmax()))
        start, end, steps = len(prompt), len(prompt) + max_new, []
        while start + 1 < end:
            size = min(block, end - start)
            ids = [out[start]] + [mask] * (size - 1)
            _, taps = self.target(out[:start])
            hidden = self.draft_hidden(taps, self.embed[ids])
            ids[1:] = self.select(hidden, out[start])
            posterior = self.target(out[:start] + ids)[0][start:].argmax(-1).tolist()
            accepted = 0
            while accepted < size - 1 and ids[1 + accepted] == posterior[accepted]:
                accepted += 1
            if size == block:
                steps.append((ids[1:], accepted))
            out = out[:start] + ids[: accepted + 1] + [posterior[accepted]]
            start += min(accepted + 1, end - start - 1)
            out = out[: start + 1]
        return out[len(prompt): min(start + 1, end)], steps


# ---- fixtures ----------------------------------------------------------------------------------
def _quiet_sublayers(state, cfg):
    """A `state_fn` for `make_dflash2_draft`: o_proj and down_proj ~1e-7, so the sublayers add ~nothing
    and every masked row's final hidden is the same vector."""
    rng = torch.Generator().manual_seed(7)
    return {k: (torch.randn(v.shape, generator=rng) * 1e-7 if ("o_proj" in k or "down_proj" in k) else v)
            for k, v in state.items()}


def _finish_follow_draft(draft_dir: Path, embed: np.ndarray, f: list[int], s: float = 1000.0) -> None:
    """Make the selector of a `_quiet_sublayers` draft propose f(a) after token a: hidden_projection maps
    the masked rows' hidden y to ones, and the codebooks score s * [b == f(a)] (rank = top_k = the
    vocabulary size: every token is a candidate)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((draft_dir / "config.json").read_text())
    state = load_file(str(draft_dir / "model.safetensors"))
    h = torch.tensor(embed[cfg["dflash_config"]["mask_token_id"]], dtype=F64)
    y = _rms(h, state["norm.weight"].to(F64), cfg["rms_norm_eps"])
    v = len(f)
    state["candidate_selector.hidden_projection.weight"] = (y / (y @ y)).expand(v, -1).float().contiguous()
    state["candidate_selector.predecessor_codebook"] = (s * torch.eye(v)).contiguous()
    successor = torch.zeros(v, v)
    for a, b in enumerate(f):
        successor[b, a] = 1.0
    state["candidate_selector.successor_codebook"] = successor
    save_file(state, str(draft_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(reference, artifact) of a random DFlash 2 draft for the tiny Qwen3 target."""
    root = rf.checkpoints("qwen3", tmp_path_factory)
    out = tmp_path_factory.mktemp("dflash2_dense")
    # Muse-Glimmer's optional fields set (the multiplier and scale at the top level: the reference reads both places)
    draft = tiny_models.make_dflash2_draft(out / "draft", root / "target", block_size=BLOCK,
                                           dflash_config={"final_logit_softcapping": 4.0},
                                           output_multiplier=0.8, input_embedding_scale=1.5)
    build(BuildOptions(str(root / "target"), str(draft), out / "art", max_seq_len=128, quiet=True))
    return Reference(draft, rf.hf_model(root / "target")), out / "art"


@pytest.fixture(scope="module")
def following(tmp_path_factory):
    """(reference, artifact, prompt) of a context-free Qwen3 target (next token = f(token): attention and
    MLP add ~nothing) and a DFlash 2 draft whose selector proposes f's chain, except after one token:
    the prompt's chain has 10 distinct tokens, the 10th proposes wrong (so its first block is accepted
    whole, the next one not)."""
    out = tmp_path_factory.mktemp("dflash2_follow")
    vocab = 64
    target = tiny_models.make_target(out / "target", family="qwen3", tie=False, seed=11, vocab=vocab)
    # attention and MLP add ~nothing; the LM head x8 makes the target's distributions peaked (T > 0 tests)
    rf._patch_safetensors(target / "model.safetensors", lambda st: {
        k: (v * 8 if k == "lm_head.weight" else v) for k, v in rf._near_zero_projections(st).items()})
    hf = rf.hf_model(target)
    with torch.no_grad():
        f = hf(torch.arange(vocab)[:, None]).logits[:, -1].argmax(-1).tolist()

    def chain(t: int) -> list[int]:
        seen = [t]
        while f[seen[-1]] not in seen:
            seen.append(f[seen[-1]])
        return seen

    start = max(range(vocab), key=lambda t: len(chain(t)))
    assert len(chain(start)) >= 10, "no long enough chain: change the target's seed"
    wrong = list(f)
    wrong[chain(start)[9]] = (f[chain(start)[9]] + 1) % vocab
    draft = tiny_models.make_dflash2_draft(out / "draft", target, block_size=BLOCK, rank=vocab, top_k=vocab,
                                           mask_token_id=vocab - 1, state_fn=_quiet_sublayers)
    _finish_follow_draft(draft, hf.get_input_embeddings().weight.detach().numpy(), wrong)
    build(BuildOptions(str(target), str(draft), out / "art", max_seq_len=128, quiet=True))
    return Reference(draft, hf), out / "art", [start]


def _steps(res) -> list[tuple[list[int], int]]:
    return [(s["proposed"], s["accepted"]) for s in res.steps if len(s["proposed"]) == BLOCK - 1]


# ---- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["dense", "following"])
def test_proposals_and_acceptance_match_the_reference_loop(request, which):
    """Greedy, every proposal verified: each full-block step's proposals and acceptance equal the
    reference's (random weights: mostly rejected; the following draft: whole blocks and a broken one),
    and the output is the target's greedy output (the reference's)."""
    ref, art, *rest = request.getfixturevalue(which)
    sess = runtime.load(art)
    prompt = rest[0] if rest else [3, 9, 27, 5, 11]
    want, want_steps = ref.generate(prompt, 40)
    res = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], verify_len="all", record_steps=True)
    assert res.output_ids == want
    got_steps = _steps(res)
    # the reference verifies as many proposals as tokens remain; the runtime one fewer (the bonus token
    # then still fits), so its last full block may come one step earlier
    assert got_steps == want_steps[: len(got_steps)] and len(got_steps) >= len(want_steps) - 1
    if which == "following":  # whole blocks accepted, and the one broken link cuts a block short
        assert want_steps[0][1] == BLOCK - 1 and want_steps[1][1] < BLOCK - 1


def test_greedy_speculation_equals_plain_under_every_policy(following):
    _, art, _ = following
    sess = runtime.load(art)
    plain = sess.generate([5, 1, 7], max_new_tokens=48, stop_token_ids=[], block_size=1).output_ids
    for policy in ("auto", "all", 3, "2+3"):  # "2+3": a verify tree of the candidates' ranks
        res = sess.generate([5, 1, 7], max_new_tokens=48, stop_token_ids=[], verify_len=policy)
        assert res.output_ids == plain, policy
    assert max(res.acceptance_lengths) > 2


@pytest.mark.parametrize("sampling", [dict(temperature=0.9), dict(temperature=0.7, top_k=5),
                                      dict(temperature=1.1, top_p=0.8)])
def test_a_seed_gives_the_plain_reply(following, sampling):
    """Sampling stays exact: the same seed gives the same reply with and without speculation."""
    _, art, _ = following
    sess = runtime.load(art)
    for seed in (0, 1, 2):
        plain = sess.generate([4, 2], max_new_tokens=32, stop_token_ids=[], block_size=1, seed=seed, **sampling)
        spec = sess.generate([4, 2], max_new_tokens=32, stop_token_ids=[], verify_len="all", seed=seed, **sampling)
        assert spec.output_ids == plain.output_ids, (seed, sampling)


@pytest.mark.slow  # a measurement (the reference loop at T > 0); fast: test_a_seed_gives_the_plain_reply
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_sampling_rules_compared(following, temperature):
    """Acceptance per full-block step at T > 0 on the following fixture: this project's rule (the runtime:
    the selector's argmax path, accepted while it equals the target's seeded samples; a seed gives the
    plain reply) against the reference's (the selector samples its path, rejection sampling against its
    q). Both must accept real blocks here (f's chain is what the target likes most); the figures are
    printed for docs/dflash2.md (`pytest tests/test_dflash2.py -k sampling_rules -s`)."""
    ref, art, prompt = following
    sess = runtime.load(art)
    ours, theirs = [], []
    for seed in range(6):
        res = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], verify_len="all", seed=seed,
                            temperature=temperature, record_steps=True)
        ours += [a for _, a in _steps(res)]
        theirs += ref.sampled_acceptance(prompt, 40, temperature, seed)
    mean_ours, mean_theirs = float(np.mean(ours)), float(np.mean(theirs))
    print(f"\nT={temperature}: accepted per block of {BLOCK - 1}: exact-seed rule {mean_ours:.2f} "
          f"({len(ours)} steps), reference rejection rule {mean_theirs:.2f} ({len(theirs)} steps)")
    assert mean_ours > 1.0 and mean_theirs > 1.0


def test_graph_is_standard_and_fixed_to_the_block(dense):
    import onnx

    _, art = dense
    manifest = json.loads((art / "manifest.json").read_text())
    d = manifest["draft"]
    assert d["family"] == "dflash2" and d["selector"]["top_k"] == 8 and d["block_attention"] == ["bidirectional"] * 2
    assert (d["output_multiplier"], d["input_embedding_scale"], d["final_logit_softcapping"]) == (0.8, 1.5, 4.0)
    inputs = {i["name"]: i["shape"] for i in manifest["io"]["draft"]["inputs"]}
    assert inputs["block_embeddings"][0] == BLOCK and inputs["anchor_ids"] == [1]
    model = onnx.load(str(art / "draft.onnx"), load_external_data=False)
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"} and max(o.version for o in model.opset_import) <= 21
    assert {n.domain for n in model.graph.node} <= {""}
    sess = runtime.load(art)
    with pytest.raises(DFlashError, match=rf"block_size {BLOCK + 1} must be between 1 and {BLOCK} \(the draft's graph is fixed"):
        sess.generate([1, 2], max_new_tokens=4, block_size=BLOCK + 1)
    # a smaller block runs the fixed graph and verifies at most block_size - 1 proposals
    small = sess.generate([3, 9], max_new_tokens=20, stop_token_ids=[], block_size=4, verify_len="all")
    assert small.output_ids == sess.generate([3, 9], max_new_tokens=20, stop_token_ids=[], block_size=1).output_ids


@pytest.mark.slow  # a hybrid build; fast: the dense target against the same reference
def test_hybrid_target(hybrid_pair, tmp_path):
    """A Qwen3.5 hybrid target with a DFlash 2 draft: proposals and acceptance as the reference's, greedy
    output the HF model's."""
    draft = tiny_models.make_dflash2_draft(tmp_path / "draft", hybrid_pair.target_dir, block_size=BLOCK,
                                           taps=[0, 1])
    build(BuildOptions(str(hybrid_pair.target_dir), str(draft), tmp_path / "art", max_seq_len=128, quiet=True))
    ref = Reference(draft, hybrid_pair.model)
    want, want_steps = ref.generate([3, 9, 27], 24)
    res = runtime.load(tmp_path / "art").generate([3, 9, 27], max_new_tokens=24, stop_token_ids=[], verify_len="all",
                                                  record_steps=True)
    assert res.output_ids == want
    got_steps = _steps(res)
    assert got_steps == want_steps[: len(got_steps)] and len(got_steps) >= len(want_steps) - 1


# ---- checkpoint errors ---------------------------------------------------------------------------
def _rewrite(draft: Path, cfg_fn=None, state_fn=None) -> Path:
    from safetensors.torch import load_file, save_file

    if cfg_fn is not None:
        cfg = json.loads((draft / "config.json").read_text())
        cfg_fn(cfg)
        (draft / "config.json").write_text(json.dumps(cfg))
    if state_fn is not None:
        state = load_file(str(draft / "model.safetensors"))
        save_file(state_fn(state), str(draft / "model.safetensors"))
    return draft


@pytest.mark.parametrize("cfg_fn, state_fn, match", [
    (lambda c: c["dflash_config"].pop("selector_rank"), None, r"dflash_config lacks \['selector_rank'\]"),
    (lambda c: c["dflash_config"].update(conv_group_size=7), None, r"conv_group_size 7 does not divide hidden_size 64"),
    (lambda c: c["dflash_config"].update(selector_top_k=1000), None, r"selector_top_k 1000 exceeds the target vocabulary"),
    (lambda c: c["dflash_config"].update(output_multiplier="x"), None, r"output_multiplier 'x' must be a finite number"),
    (lambda c: c.update(input_embedding_scale=float("inf")), None, r"input_embedding_scale inf must be a finite number"),
    (lambda c: c.update(output_multiplier=1e300), None, r"output_multiplier 1e\+300 is beyond \+-10000"),
    (lambda c: c["dflash_config"].update(final_logit_softcapping=1e-300), None, r"would squash every logit to 0"),
    (lambda c: c.update(architectures=["DFlash2DraftModel", "DFlashDraftModel"]), None, r"of more than one draft family"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), None,
     r"holds DFlash 2 weights \(candidate_selector\.\*\) but .* set \"architectures\": \[\"DFlash2DraftModel\"\]"),
    (None, lambda s: {**s, "candidate_selector.successor_codebook.weight": s["candidate_selector.successor_codebook"].clone()},
     r"holds both candidate_selector.successor_codebook and candidate_selector.successor_codebook.weight; keep one"),
    (None, lambda s: {k: v for k, v in s.items() if "mlp_conv" not in k}, r"lacks weights \['layers.0.mlp_conv"),
    (None, lambda s: {**s, "candidate_selector.successor_codebook": s["candidate_selector.successor_codebook"][:, :8].contiguous()},
     r"candidate_selector.successor_codebook has shape \(96, 8\) but the config implies \(96, 32\)"),
])
def test_bad_checkpoints_are_refused_before_any_output(tmp_path, tmp_path_factory, cfg_fn, state_fn, match):
    root = rf.checkpoints("qwen3", tmp_path_factory)
    draft = _rewrite(tiny_models.make_dflash2_draft(tmp_path / "draft", root / "target"), cfg_fn, state_fn)
    with pytest.raises(DFlashError, match=match):
        build(BuildOptions(str(root / "target"), str(draft), tmp_path / "art", quiet=True))
    rf.no_partial_output(tmp_path / "art")


def test_codebooks_saved_with_a_weight_suffix_load(tmp_path, tmp_path_factory):
    """transformers' key mapping saves the codebooks as `<name>.weight`; both spellings load alike."""
    from dflash_export.checkpoint.dflash2 import load_dflash2_spec
    from dflash_export.families.registry import load_target_spec

    root = rf.checkpoints("qwen3", tmp_path_factory)
    draft = tiny_models.make_dflash2_draft(tmp_path / "draft", root / "target")
    tspec = load_target_spec(root / "target")
    _, plain = load_dflash2_spec(draft, tspec)
    _rewrite(draft, state_fn=lambda s: {(k + ".weight" if k.endswith("codebook") else k): v for k, v in s.items()})
    spec, renamed = load_dflash2_spec(draft, tspec)
    assert sorted(renamed) == sorted(plain) and len(plain) == 15 * 2 + 6  # 15 per layer; fc, 2 norms, selector
    assert torch.equal(renamed["candidate_selector.predecessor_codebook"], plain["candidate_selector.predecessor_codebook"])
    assert spec.selector_rank == 32 and spec.selector_top_k == 8 and spec.causal_layers == (False, False)


def test_the_released_shape_has_the_released_81_tensors(tmp_path_factory):
    """dflash_export's expected names for a 5-layer draft are the released header's 81 tensors."""
    from dflash_export.checkpoint.dflash2 import (
        dflash2_weight_shapes,
        load_dflash2_spec,
    )
    from dflash_export.families.registry import load_target_spec

    root = rf.checkpoints("qwen3", tmp_path_factory)
    draft = tiny_models.make_dflash2_draft(tmp_path_factory.mktemp("d5") / "draft", root / "target", layers=5)
    spec, state = load_dflash2_spec(draft, load_target_spec(root / "target"))
    shapes = dflash2_weight_shapes(spec)
    assert len(shapes) == 81 and set(shapes) == set(state)
    assert shapes["layers.4.attention_conv.kernel_projection.weight"] == (2 * 2 * 64 // 16, 64)
    assert shapes["candidate_selector.predecessor_codebook"] == (96, 32)
    assert dflash2_weight_shapes(replace(spec, selector_rank=256))["candidate_selector.successor_codebook"] == (96, 256)


# ---- check -------------------------------------------------------------------------------------
@pytest.mark.slow  # two `check` runs; fast: test_check.py's proposing-draft checks
def test_check_compares_the_selector_with_the_pytorch_module(dense, tmp_path, capsys):
    """`check` passes (proposal ids equal, their selector probabilities within tolerance) and fails once
    the graph's successor codebook is nudged (the same ids may survive: the probabilities do not)."""
    import re
    import shutil

    import onnx
    from onnx import numpy_helper

    from dflash_export.cli import main

    _, art = dense
    assert main(["check", str(art)]) == 0
    text = capsys.readouterr().out
    found = re.findall(r"^(draft_(?:prefill|step))\s+(draft_top_(?:ids|probs))\s+\[[^\]]*\].*?\b(ok|FAIL)\b", text, re.M)
    rows = {f"{case} {output}": result for case, output, result in found}
    assert rows == {f"draft_{c} draft_top_{o}": "ok" for c in ("prefill", "step") for o in ("ids", "probs")}
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    model = onnx.load(str(bad / "draft.onnx"))
    book = next(i for i in model.graph.initializer if i.name == "candidate_selector.successor_codebook")
    book.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(book) * 1.5, book.name))
    onnx.save(model, str(bad / "draft.onnx"))
    assert main(["check", str(bad)]) != 0
    assert re.search(r"^draft_prefill\s+draft_top_probs .* FAIL", capsys.readouterr().out, re.M)


# ---- TensorRT (a test double only: nothing ran on TensorRT here) ----------------------------------
@pytest.mark.slow  # engines through the double; fast: test_trt_backend_double.py
def test_tensorrt_path_through_the_test_double(dense, tmp_path, doubles):  # noqa: F811
    """The engine builder's profiles (a fixed block, the anchor input) and the TensorRT backend's bindings,
    through `test_trt_backend_double`'s TensorRT and CUDA doubles (onnxruntime executes the "engines"):
    the same steps and output as onnxruntime, greedy and sampled."""
    import shutil

    from dflash_export.trt.engine import build_engines

    _, art = dense
    out = tmp_path / "art"
    shutil.copytree(art, out)
    build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True)
    ort_sess, trt_sess = runtime.load(out), runtime.load(out, backend="trt")
    for kw in (dict(verify_len="all"), dict(verify_len=3, temperature=0.9, seed=2)):
        a = ort_sess.generate([3, 9, 27], max_new_tokens=24, stop_token_ids=[], record_steps=True, **kw)
        b = trt_sess.generate([3, 9, 27], max_new_tokens=24, stop_token_ids=[], record_steps=True, **kw)
        assert b.output_ids == a.output_ids and b.steps == a.steps, kw
    trt_sess.backend.close()
    assert not doubles["cuda"].blocks


def test_random_released_layout_drafts_load(tmp_path, tmp_path_factory):
    """`random_checkpoint.dflash2_draft` (the 27B-shape measurements' draft, here at the tiny target's
    width) writes the released 81-tensor layout and config that `build` reads."""
    from dflash_export.checkpoint.dflash2 import load_dflash2_spec
    from dflash_export.eval.random_checkpoint import (
        DFLASH2_DRAFT,
        dflash2_draft,
        write_checkpoint,
    )
    from dflash_export.families.registry import load_target_spec

    root = rf.checkpoints("qwen3", tmp_path_factory)
    tspec = load_target_spec(root / "target")
    small = dict(DFLASH2_DRAFT, heads=4, kv_heads=2, head_dim=16, rank=32, mask_token_id=95)
    shapes, config = dflash2_draft(64, 128, tspec.arch.num_layers, tspec.vocab_size, small)
    write_checkpoint(tmp_path / "draft", shapes, "bf16", 0, 1.0, config)
    spec, state = load_dflash2_spec(tmp_path / "draft", tspec)
    assert len(state) == 81 and spec.block_size == 8 and spec.selector_top_k == 16 and spec.sliding_window == 2048
    assert spec.target_layer_ids == (1, 1, 1, 1, 1) and spec.causal_layers == (False,) * 5
