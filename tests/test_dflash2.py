"""DFlash 2 drafts (`DFlash2DraftModel`): a tiny draft in the released format, built with a tiny Qwen3
target and a tiny Qwen3.5 hybrid, against a from-scratch port of the official reference's loop
(`dflash2_reference.Reference`: float64, no caches)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import runtime_fixtures as rf
import tiny_models
import torch
from dflash2_reference import F64, Reference, rms
from trt_doubles import GPU, FakeTensorRT, doubles  # noqa: F401 - `doubles` is a fixture

import runtime
from dflash_export.build import BuildOptions, build
from runtime.errors import DFlashError

BLOCK = 8


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
    y = rms(h, state["norm.weight"].to(F64), cfg["rms_norm_eps"])
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
@pytest.mark.slow  # two reference loops (20 s each on AVX2); fast: test_a_seed_gives_the_plain_reply
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


@pytest.mark.slow  # a DFlash 2 artifact build: `make test`
def test_greedy_speculation_equals_plain_under_every_policy(following):
    _, art, _ = following
    sess = runtime.load(art)
    plain = sess.generate([5, 1, 7], max_new_tokens=48, stop_token_ids=[], block_size=1).output_ids
    for policy in ("auto", "all", 3, "2+3"):  # "2+3": a verify tree of the candidates' ranks
        res = sess.generate([5, 1, 7], max_new_tokens=48, stop_token_ids=[], verify_len=policy)
        assert res.output_ids == plain, policy
    assert max(res.acceptance_lengths) > 2


@pytest.mark.slow  # a DFlash 2 artifact build: `make test`
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


@pytest.mark.slow  # a DFlash 2 artifact build: `make test`
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


@pytest.mark.nightly  # a hybrid build; `make test`: the dense target against the same reference
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
@pytest.mark.slow  # engines through the double; fast: test_trt_backend_double.py (doubles: trt_doubles.py)
def test_tensorrt_path_through_the_test_double(dense, tmp_path, doubles):  # noqa: F811
    """The engine builder's profiles (a fixed block, the anchor input) and the TensorRT backend's bindings,
    through `trt_doubles`'s TensorRT and CUDA doubles (onnxruntime executes the "engines"):
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
    from dflash_export.eval.scale.random_checkpoint import (
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
