"""`build --batched` of a Qwen3.5 hybrid and `runtime.batching.BatchEngine` on it: one Gated DeltaNet state
per slot, rolled back exactly. Every stream's greedy output equals its batch-1 output on the batched
graph (whatever joins or leaves, plain or verifying proposals that are accepted and rejected), equals
the one-sequence Session's, and a seed gives the same sampled reply at any batch size."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hybrid_fixtures import VOCAB, batched_hybrid_artifact
from test_batching import _drain, _oracle_drafts
from trt_doubles import doubles  # noqa: F401 (a fixture)

import runtime
from runtime.batching import BatchEngine

# the batched hybrid build (over a minute on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow

# prompts longer than the hybrid's 64 rows per call are prefilled in several calls
PROMPT_LENGTHS = (5, 70, 12, 3, 30, 9)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A 3-layer hybrid ([GDN, GDN, attention]: every cache kind, two recurrent states per slot) with a
    proposing draft, built with `--batched` (`hybrid_fixtures.batched_hybrid_artifact`)."""
    return batched_hybrid_artifact(tmp_path_factory)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB - 2, size=n)] for n in PROMPT_LENGTHS]


def test_the_manifest_lists_the_batched_hybrid(art):
    m = json.loads((art / "manifest.json").read_text())
    assert m["target_batched"]["graph"] == "target_batched.onnx"
    assert "draft_batched" in m and m["draft"]["proposes"] is True if "proposes" in m["draft"] else True
    names = {i["name"] for i in m["io"]["target_batched"]["inputs"]}
    assert {"state_slots", "pending_index", "pending_lengths", "recurrent_state_0", "pending_qkv_1",
            "past_key_2"} <= names
    assert "past_key_0" not in names
    # a tiny model's one-sequence graph keeps its weights inline: the batched graph holds its own copy
    assert not (art / "target.onnx.data").exists() and m["target_batched"]["weights"] == "inline, a copy of the one-sequence graph's"


def test_greedy_streams_equal_batch1_whatever_joins_or_leaves(art):
    """6 prompts (3-70 tokens) on 3 slots: streams join as others finish, the 70-token prompt prefills in
    two calls beside running streams; each equals its reply alone on the batched graph and the
    one-sequence Session's plain reply."""
    prompts, lengths = _prompts(), [12, 20, 5, 16, 9, 14]
    with BatchEngine(art, max_batch=1, speculation=False) as engine:
        alone = [engine.generate([p], max_new_tokens=n, stop_token_ids=[], reuse_prefix=False)[0].output_ids
                 for p, n in zip(prompts, lengths)]
    with runtime.load(art) as s:
        session = [s.generate(p, max_new_tokens=n, block_size=1, stop_token_ids=[], reuse_prefix=False).output_ids
                   for p, n in zip(prompts, lengths)]
    with BatchEngine(art, max_batch=3, prefill_chunk=64) as engine:
        got = _drain([engine.stream(p, max_new_tokens=n, stop_token_ids=[], reuse_prefix=False)
                      for p, n in zip(prompts, lengths)])
    assert got == alone
    assert got == session


def test_verified_proposals_roll_the_states_back_exactly(art):
    """Proposals that are accepted whole, in part or not at all (oracle drafts with one wrong id placed
    by the step): every stream still equals its plain reply."""
    prompts = _prompts(1)
    with BatchEngine(art, max_batch=3, speculation=False) as engine:
        expected = _drain([engine.stream(p, max_new_tokens=18, stop_token_ids=[], reuse_prefix=False) for p in prompts])
    with BatchEngine(art, max_batch=3) as engine:
        _oracle_drafts(engine, {tuple(p): e for p, e in zip(prompts, expected)})
        verified = _drain([engine.stream(p, max_new_tokens=18, stop_token_ids=[], reuse_prefix=False, verify_len=3)
                           for p in prompts])
        assert engine.status()["speculative_steps"] > 0
    assert verified == expected


def test_seeded_sampling_gives_the_same_reply_at_any_batch_size(art):
    prompts = _prompts(2)[:4]
    kinds = [dict(temperature=0.8, seed=3), dict(temperature=1.1, top_k=5, seed=4), dict(), dict(temperature=0.7, seed=5)]
    with BatchEngine(art, max_batch=1, speculation=False) as engine:
        alone = [engine.generate([p], max_new_tokens=12, stop_token_ids=[], **kw)[0].output_ids
                 for p, kw in zip(prompts, kinds)]
    with BatchEngine(art, max_batch=4) as engine:
        got = _drain([engine.stream(p, max_new_tokens=12, stop_token_ids=[], **kw) for p, kw in zip(prompts, kinds)])
    assert got == alone


def test_a_follow_up_reuses_its_slots_state(art):
    """A second turn that extends the first turn's prompt and reply reuses the slot (prefills only the
    new rows) and equals a fresh engine's reply to the whole conversation; a prompt that shares only a
    shorter prefix (the state cannot roll back that far) prefills from the start and is still right."""
    first = _prompts(3)[2]
    with BatchEngine(art, max_batch=1, speculation=False) as engine:
        reply = engine.generate([first], max_new_tokens=8, stop_token_ids=[])[0].output_ids
        follow = first + reply + [7, 8, 9]
        handle = engine.stream(follow, max_new_tokens=8, stop_token_ids=[])
        _drain([handle])
        reused = handle.result
        branch = first[:6] + [11, 12]
        branched = engine.generate([branch], max_new_tokens=8, stop_token_ids=[])[0].output_ids
    with BatchEngine(art, max_batch=1, speculation=False) as engine:
        fresh = engine.generate([follow, branch], max_new_tokens=8, stop_token_ids=[], reuse_prefix=False)
    assert reused.output_ids == fresh[0].output_ids
    assert branched == fresh[1].output_ids


def test_batched_hybrid_through_the_tensorrt_double(art, tmp_path_factory, doubles):  # noqa: F811
    """The TensorRT backend's own code on the batched hybrid graph, through the test double (NOT TensorRT:
    the double runs the ONNX graph with onnxruntime, refusing shapes outside the engine's profiles):
    `engine --max-batch 2` gives profiles for the GDN states, pending rows and 64-row prefill chunks,
    and the streams (a 70-token prompt, verified proposals) equal onnxruntime's."""
    import shutil

    from trt_doubles import GPU, FakeTensorRT

    from dflash_export.trt.engine import build_engines

    out = tmp_path_factory.mktemp("trt_batched_hybrid") / "artifact"
    shutil.copytree(art, out)
    manifest = build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True, max_batch=2)
    prefill = next(p for p in manifest["trt"]["profiles"]["target_batched"] if p["name"] == "batched_prefill")
    assert prefill["shapes"]["input_ids"][2] == [2, 64] and prefill["shapes"]["recurrent_state_0"][0][0] == 2
    prompts = _prompts(4)[:3]
    with BatchEngine(out, max_batch=2, backend="ort") as engine:
        expected = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[]) for p in prompts])
    with BatchEngine(out, max_batch=2, backend="trt") as engine:
        got = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[]) for p in prompts])
        verified = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[], verify_len="all") for p in prompts])
        assert engine.status()["speculative_steps"] > 0
    assert got == expected
    assert verified == expected


@pytest.mark.parametrize("edit", ["no max_call_rows", "max_call_rows 0", "no gdn", "gdn.conv_dim 'x'"])
def test_a_damaged_hybrid_manifest_is_one_clear_error(art, tmp_path, edit):
    import shutil

    from runtime.errors import DFlashError

    out = tmp_path / "artifact"
    shutil.copytree(art, out)
    m = json.loads((out / "manifest.json").read_text())
    t = m["target"]
    {"no max_call_rows": lambda: t.pop("max_call_rows"), "max_call_rows 0": lambda: t.update(max_call_rows=0),
     "no gdn": lambda: t.pop("gdn"), "gdn.conv_dim 'x'": lambda: t["gdn"].update(conv_dim="x")}[edit]()
    (out / "manifest.json").write_text(json.dumps(m))
    for load in (lambda: BatchEngine(out, max_batch=2), lambda: runtime.load(out)):
        with pytest.raises(DFlashError, match=r"target\.(max_call_rows|gdn\.\w+) is .*positive integer"):
            load()
