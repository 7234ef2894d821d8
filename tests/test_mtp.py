"""Qwen3.5's multi-token-prediction head (`nn.mtp`, `export.mtp`): the exported `mtp.onnx` against an
independent reference recomputed from scratch at every call (no caches: the entries as they stand, the
layer as Hugging Face's one-layer Qwen3.5 stack over `inputs_embeds`), through catch-up, chained and
rolled-back calls; the graph on the TensorRT 10 list; the checkpoint checks (`families.qwen3_5.mtp_source`)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hybrid_fixtures import CONFIG
from trt_doubles import doubles  # noqa: F401 (a fixture)
from tolerances import assert_fp32_close

from dflash_export.checkpoint.hybrid import HybridSpec
from dflash_export.checkpoint.weights import WeightSource
from dflash_export.nn.mtp import MTPHead
from runtime.errors import DFlashError

D = CONFIG["hidden_size"]


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random head in the checkpoint's names (`mtp.*`) with the target's embedding (tied LM head);
    norms away from zero, so every (1 + w) scale matters."""
    torch.manual_seed(seed)
    spec = HybridSpec.from_config(CONFIG)
    head = MTPHead(spec)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15))
    out = {}
    for name, p in head.state_dict().items():
        out["model.embed_tokens.weight" if name.startswith("model.") else f"mtp.{name}"] = p.clone()
    return out


def _spec(**extra) -> HybridSpec:
    return HybridSpec.from_config({**CONFIG, **extra})


class Reference:
    """The head recomputed from its definition over every entry so far (vLLM's computation, written
    here from the tensors: fc over the (1 + w)-normed embedding and hidden state, then Hugging Face's
    Qwen3.5 decoder layer and final norm over `inputs_embeds` at positions 0..n-1)."""

    def __init__(self, ckpt: dict[str, torch.Tensor]):
        import transformers

        cfg = transformers.Qwen3_5TextConfig(**{**CONFIG, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
        cfg._attn_implementation = "eager"
        self.model = transformers.Qwen3_5ForCausalLM(cfg).eval().double()
        state = {k.replace("mtp.layers.0.", "model.layers.0."): v for k, v in ckpt.items() if k.startswith("mtp.layers.")}
        state["model.norm.weight"] = ckpt["mtp.norm.weight"]
        state["model.embed_tokens.weight"] = ckpt["model.embed_tokens.weight"]
        missing, unexpected = self.model.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        self.ckpt = {k: v.double() for k, v in ckpt.items()}
        eps = CONFIG.get("rms_norm_eps", 1e-6)
        self.norm = lambda x, w: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)  # noqa: E731

    def __call__(self, tokens: list[int], hiddens: np.ndarray) -> tuple[int, np.ndarray]:
        """(the greedy token after the last entry, its post-norm output) for entries (tokens[i], hiddens[i])."""
        c = self.ckpt
        e = self.norm(c["model.embed_tokens.weight"][torch.tensor(tokens)], c["mtp.pre_fc_norm_embedding.weight"])
        h = self.norm(torch.from_numpy(np.asarray(hiddens, np.float64)), c["mtp.pre_fc_norm_hidden.weight"])
        x = torch.cat([e, h], dim=-1) @ c["mtp.fc.weight"].T
        with torch.no_grad():
            out = self.model.model(inputs_embeds=x[None]).last_hidden_state[0, -1]
        return int(torch.argmax(out @ c["model.embed_tokens.weight"].T)), out.numpy()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The head's graph, exported from the checkpoint tensors through the build's own hooks."""
    import onnxruntime as ort

    from dflash_export.checkpoint.target import TargetSpec
    from dflash_export.families import qwen3_5

    ckpt = _checkpoint()
    spec = _spec()
    tspec = TargetSpec(path="tiny", family="qwen3_5", arch=spec.attention_spec(), vocab_size=spec.vocab_size,
                       tie_word_embeddings=True, eos_token_ids=[], hybrid=spec)
    heads = qwen3_5.mtp_source(tspec, WeightSource("tiny", tensors=ckpt))
    path = tmp_path_factory.mktemp("mtp") / "mtp.onnx"
    qwen3_5.export_mtp_for_build(tspec, heads, path, torch.float32, None)
    return ckpt, path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.slow  # an export (torch.export: 10-15 s on AVX2)
def test_catch_up_chained_and_rolled_back_calls_equal_the_reference(exported):
    """The runtime's call pattern: catch-up entries for a prompt, proposals chained on the head's own
    output, then a rollback to the verified length and the accepted entries entered again with the
    target's states. Each call's token equals the reference's, its hidden state within fp32 rounding."""
    ckpt, _, sess = exported
    ref = Reference(ckpt)
    rng = np.random.default_rng(3)
    kv = np.zeros((0, CONFIG["num_key_value_heads"], CONFIG["head_dim"]), np.float32)
    keys, values = kv, kv
    tokens, hiddens = [], []

    def call(new_tokens, new_hiddens):
        nonlocal keys, values
        ids, hid, k, v = sess.run(None, {"input_ids": np.asarray(new_tokens, np.int64), "past_key": keys,
                                         "past_value": values, "hidden": np.asarray(new_hiddens, np.float32)})
        keys, values = np.concatenate([keys, k]), np.concatenate([values, v])
        tokens.extend(new_tokens)
        hiddens.extend(new_hiddens)
        want_id, want_hidden = ref(tokens, hiddens)
        assert int(ids[0]) == want_id
        assert_fp32_close(hid[0], want_hidden, reduction=4 * D, depth=6, what=f"entry {len(tokens) - 1}")
        return int(ids[0]), hid[0]

    target_states = rng.standard_normal((12, D)).astype(np.float32)
    token, state = call(list(rng.integers(0, CONFIG["vocab_size"], 6)), list(target_states[:6]))  # catch-up
    chained = []
    for _ in range(3):  # proposals: each entry is (the drafted token, the head's own output)
        chained.append(token)
        token, state = call([token], [state])
    keys, values = keys[:6], values[:6]  # verified: one proposal accepted; roll back to the catch-up entries
    del tokens[6:], hiddens[6:]
    call([chained[0], 7], list(target_states[6:8]))  # the accepted token and the bonus, with the target's states


@pytest.mark.slow  # the export above
def test_the_graph_is_standard_and_its_io_is_static(exported):
    from dflash_export.export.checks import check_graph

    _, path, sess = exported
    assert check_graph(path)["ops"]  # every operator on the TensorRT 10 list (it raises otherwise)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "hidden", "past_key", "past_value"]
    assert [o.name for o in sess.get_outputs()] == ["next_ids", "mtp_hidden", "key", "value"]


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("mtp.fc.weight"), r"mtp.fc.weight|fc.weight"),
    (lambda c: c.update({"mtp.norm.weight": torch.zeros(D + 1)}), "norm.weight"),
    (lambda c: c.update({"mtp.layers.1.input_layernorm.weight": torch.zeros(D)}), "mtp_num_hidden_layers"),
])
def test_malformed_heads_are_refused_by_name(edit, match):
    from dflash_export.checkpoint.target import TargetSpec
    from dflash_export.families import qwen3_5

    ckpt = _checkpoint()
    edit(ckpt)
    spec = _spec()
    tspec = TargetSpec(path="tiny", family="qwen3_5", arch=spec.attention_spec(), vocab_size=spec.vocab_size,
                       tie_word_embeddings=True, eos_token_ids=[], hybrid=spec)
    with pytest.raises(DFlashError, match=match):
        qwen3_5.mtp_source(tspec, WeightSource("tiny", tensors=ckpt))


def test_two_layer_heads_and_heads_absent():
    from dflash_export.checkpoint.target import TargetSpec
    from dflash_export.families import qwen3_5

    spec = _spec(mtp_num_hidden_layers=2)
    tspec = TargetSpec(path="tiny", family="qwen3_5", arch=spec.attention_spec(), vocab_size=spec.vocab_size,
                       tie_word_embeddings=True, eos_token_ids=[], hybrid=spec)
    with pytest.raises(DFlashError, match="mtp_num_hidden_layers is 2.*--no-mtp"):
        qwen3_5.mtp_source(tspec, WeightSource("tiny", tensors=_checkpoint()))
    plain = {k: v for k, v in _checkpoint().items() if not k.startswith("mtp.")}
    assert qwen3_5.mtp_source(tspec, WeightSource("tiny", tensors=plain)) is None


def _fitted_head(model, steps: int = 150, prompts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A head fitted to `model` (a tiny random target): trained on its own greedy continuations of
    `prompts` (int64 `[n, 6]`; default 48 random ones) to predict the token after next from (next token,
    final hidden state), so its proposals are accepted often, though not always. Returns the `mtp.*`
    tensors."""
    from dflash_export.nn.layers import causal_bias, rope_cos_sin

    torch.manual_seed(0)
    spec = HybridSpec.from_config({**CONFIG, "layer_types": list(model.config.layer_types),
                                   "num_hidden_layers": model.config.num_hidden_layers})
    head = MTPHead(spec)
    head.load_state_dict({k.removeprefix("mtp."): v for k, v in _checkpoint().items() if k.startswith("mtp.")},
                         strict=False)
    head.model.embed_tokens.weight.data.copy_(model.model.embed_tokens.weight.data)
    head.model.embed_tokens.weight.requires_grad_(False)
    with torch.no_grad():  # start near "the next token again" (the fc passes the embedding, the layer adds little)
        d = spec.hidden_size
        head.fc.weight.copy_(torch.cat([torch.eye(d), 0.05 * torch.randn(d, d)], dim=1))
        head.layers[0].self_attn.o_proj.weight.mul_(0.1)
        head.layers[0].mlp.down_proj.weight.mul_(0.1)
        head.norm.weight.zero_()
    with torch.no_grad():
        prompts = torch.randint(0, CONFIG["vocab_size"], (48, 6)) if prompts is None else prompts
        seqs = model.generate(prompts, max_new_tokens=40, do_sample=False, min_new_tokens=40, pad_token_id=0)
        hidden = model(seqs, output_hidden_states=True).hidden_states[-1]
    n, kv = seqs.shape[1], torch.zeros(0, spec.num_kv_heads, spec.head_dim)
    rope = rope_cos_sin(torch.arange(n - 2), head.inv_freq, 1.0)
    causal = causal_bias(n - 2, spec.num_heads // spec.num_kv_heads)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    for step in range(steps):
        i = step % len(seqs)
        e = head.pre_fc_norm_embedding(head.model.embed_tokens(seqs[i, 1:-1]))
        x = head.fc(torch.cat([e, head.pre_fc_norm_hidden(hidden[i, :-2])], dim=-1))
        h, _ = head.layers[0](x, (kv, kv), rope, causal)
        logits = head.norm(h) @ head.head_weight().T
        loss = torch.nn.functional.cross_entropy(logits, seqs[i, 2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {f"mtp.{k}": v.detach().clone() for k, v in head.state_dict().items() if not k.startswith("model.")}


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    """A 3-layer hybrid checkpoint carrying a fitted `mtp.*` head, built (the untrained DFlash draft named
    as a directory, fp32, max_seq_len 64, `--batched`) with the target's weights in a data file, and built
    again with `--draft none` (the head alone): (checkpoint dir, artifact, the head's reference tensors,
    the Hugging Face target, the artifact without a draft)."""
    from unittest import mock

    import transformers
    from hybrid_fixtures import THREE_LAYER_TYPES, six_layer_model, untrained_draft_dir
    from safetensors.torch import save_file
    from shared_cache import shared_dir

    from dflash_export.build import BuildOptions, build
    from dflash_export.export import graphs

    def make(root):
        model = six_layer_model(THREE_LAYER_TYPES)
        model.save_pretrained(root / "target", safe_serialization=True)
        state = {k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # (tied)
        head = _fitted_head(model)
        save_file({**state, **head}, str(root / "target" / "model.safetensors"), metadata={"format": "pt"})
        untrained_draft_dir(root / "target", root / "draft")
        with mock.patch.object(graphs, "EXTERNAL_DATA_THRESHOLD", 0):
            build(BuildOptions(str(root / "target"), str(root / "draft"), root / "art", max_seq_len=64, batched=True,
                               quiet=True))
            build(BuildOptions(str(root / "target"), "none", root / "alone", max_seq_len=64, quiet=True))

    root = shared_dir(tmp_path_factory, "mtp_hybrid", make)
    from safetensors.torch import load_file

    stored = load_file(str(root / "target" / "model.safetensors"))
    ckpt = {k: v for k, v in stored.items() if k.startswith("mtp.") or k == "model.embed_tokens.weight"}
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(root / "target", dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    return root / "target", root / "art", ckpt, model, root / "alone"


@pytest.mark.slow  # a hybrid build (a minute on AVX2)
def test_build_exports_the_head_beside_the_target_reading_its_weights_file(mtp_pair):
    """`build` of a hybrid checkpoint carrying `mtp.*`: `mtp.onnx` beside the target, named in the
    manifest, equal to the reference; with the target's weights in a data file, the head's embedding
    points into that file (no second copy); `--no-mtp` sets the option that leaves it out."""
    import json

    import onnx
    import onnxruntime as ort

    from dflash_export.cli import make_parser

    _, art, ckpt, _, _ = mtp_pair
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["mtp"]["graph"] == "mtp.onnx" and manifest["io"]["mtp"]["inputs"][0]["name"] == "input_ids"
    assert manifest["mtp"]["weights_shared_with_target"] == ["model.embed_tokens.weight"]
    assert manifest["io"]["target"]["outputs"][-1]["name"] == "final_hidden"
    stored = onnx.load(str(art / "mtp.onnx"), load_external_data=False)
    embed = next(t for t in stored.graph.initializer if t.name == "model.embed_tokens.weight")
    assert {e.key: e.value for e in embed.external_data}["location"] == "target.onnx.data"
    sess = ort.InferenceSession(str(art / "mtp.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    tokens, hiddens = list(rng.integers(0, CONFIG["vocab_size"], 4)), rng.standard_normal((4, D)).astype(np.float32)
    kv = np.zeros((0, CONFIG["num_key_value_heads"], CONFIG["head_dim"]), np.float32)
    ids, out, _, _ = sess.run(None, {"input_ids": np.asarray(tokens, np.int64), "hidden": hiddens, "past_key": kv,
                                     "past_value": kv})
    want_id, want = Reference(ckpt)(tokens, hiddens)
    assert int(ids[0]) == want_id
    assert_fp32_close(out[0], want, reduction=4 * D, depth=6, what="the built head")
    args = make_parser().parse_args(["build", "--no-mtp"])
    assert args.mtp is False and make_parser().parse_args(["build"]).mtp is True


def _reference_steps(model, ref: Reference, prompt: list[int], n_new: int, chain: int):
    """Greedy decoding with the MTP head recomputed from scratch at every step (no caches anywhere): per
    step (proposals, accepted), and the reply. The target's final hidden states are Hugging Face's."""
    seq, steps = list(prompt), []
    with torch.no_grad():
        def target(ids):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            return out.logits[0].argmax(-1).tolist(), out.hidden_states[-1][0].numpy()

        greedy, _ = target(seq)
        seq.append(greedy[-1])
        while len(seq) - len(prompt) < n_new:
            limit = min(chain, n_new - (len(seq) - len(prompt)) - 1)
            if limit <= 0:
                greedy, _ = target(seq)
                seq.append(greedy[-1])
                steps.append(([], 0))
                continue
            _, hidden = target(seq[:-1])  # the rows the target has verified: all but the last token
            tokens, states = seq[1:], list(hidden)
            proposals = []
            for _ in range(limit):
                token, state = ref(tokens, states)
                proposals.append(token)
                tokens, states = tokens + [token], states + [state]
            greedy, _ = target(seq + proposals)
            posterior = greedy[len(seq) - 1:]
            acc = next((j for j, p in enumerate(proposals) if p != posterior[j]), len(proposals))
            seq += proposals[:acc] + [posterior[acc]]
            steps.append((proposals, acc))
    return seq[len(prompt):], steps


@pytest.mark.slow  # the hybrid MTP build (shared with the test above)
def test_mtp_drafting_equals_plain_and_a_from_scratch_reference(mtp_pair):
    """`drafter="mtp", verify_len=3`: the reply equals plain decoding and a reference that recomputes the
    target and the head from scratch at every step; each step's chained proposals and acceptance equal
    the reference's; `StepRecord.source` says "mtp"; seeded sampling gives the plain reply; the
    default drafter still equals plain."""
    import runtime

    _, _, ckpt, model, art = mtp_pair
    prompt = [int(t) for t in torch.randint(0, CONFIG["vocab_size"], (6,), generator=torch.Generator().manual_seed(11))]
    with runtime.load(art) as sess:
        plain = sess.generate(prompt, max_new_tokens=20, block_size=1, stop_token_ids=[])
        mtp = sess.generate(prompt, max_new_tokens=20, drafter="mtp", verify_len=3, stop_token_ids=[],
                            record_steps=True, reuse_prefix=False)
        want, steps = _reference_steps(model, Reference(ckpt), prompt, 20, 3)
        assert mtp.output_ids == plain.output_ids == want
        assert [(s["proposed"], s["accepted"]) for s in mtp.steps] == [(list(p), a) for p, a in steps]
        assert {s["source"] for s in mtp.steps if s["proposed"]} == {"mtp"}  # (the last steps, too short to draft, are plain)
        assert sum(a for _, a in steps) > 0  # the head's proposals were accepted
        again = sess.generate(prompt, max_new_tokens=20, drafter="mtp", verify_len=3, stop_token_ids=[])
        assert again.output_ids == plain.output_ids  # (the cached prefix reused, the head's cache with it)
        rejected = 0
        for kw in (dict(temperature=0.8, seed=3), dict(temperature=0.9, top_k=20, seed=5)):
            want_sampled = sess.generate(prompt, max_new_tokens=16, block_size=1, **kw).output_ids
            got = sess.generate(prompt, max_new_tokens=16, drafter="mtp", verify_len=2, record_steps=True, **kw)
            assert got.output_ids == want_sampled
            rejected += sum(s["accepted"] < len(s["proposed"]) for s in got.steps)
        assert rejected  # (samples that differ from the head's greedy proposals: the rejection path ran too)
        assert sess.generate(prompt, max_new_tokens=16, stop_token_ids=[]).output_ids == plain.output_ids[:16]


def test_drafter_mtp_without_a_head_is_one_clear_error(tmp_path_factory):
    import runtime
    import runtime_fixtures as rf

    pair = rf.artifact("qwen3", tmp_path_factory)
    with runtime.load(pair.artifact) as sess:
        with pytest.raises(DFlashError, match='drafter "mtp" needs the target\'s multi-token-prediction head'):
            sess.generate([5, 6, 7], max_new_tokens=4, drafter="mtp")
        with pytest.raises(DFlashError, match="drafter must be one of auto, dflash, mtp"):
            sess.generate([5, 6, 7], drafter="eagle")
        assert sess.generate([5, 6, 7], max_new_tokens=3, drafter="dflash").output_ids


@pytest.mark.slow  # the hybrid MTP build (shared with the tests above)
def test_auto_chooses_the_head_where_it_pays_and_leaves_it_where_it_does_not(mtp_pair, monkeypatch):
    """`drafter="auto"` on an artifact with both drafters equals plain decoding either way, and tries the
    head. (On this repetitive text lookups of 15 tokens outrun the head's chains of 3, so the policy's
    side keeps most steps.) With a head whose proposals are always wrong, only probes are MTP steps."""
    import runtime

    _, art, _, _, _ = mtp_pair
    prompt = [9, 80, 4, 41, 17, 3]
    with runtime.load(art) as sess:
        plain = sess.generate(prompt, max_new_tokens=40, block_size=1, stop_token_ids=[])
        auto = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], record_steps=True, reuse_prefix=False)
        assert auto.output_ids == plain.output_ids
        assert "mtp" in [s["source"] for s in auto.steps]
    with runtime.load(art) as sess:  # (a new session: the measured rates last a session)
        real = sess.mtp_propose
        monkeypatch.setattr(sess, "mtp_propose", lambda n, last: [(t + 1) % CONFIG["vocab_size"] for t in real(n, last)])
        wrong = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], record_steps=True, reuse_prefix=False)
        assert wrong.output_ids == plain.output_ids
        sources = [s["source"] for s in wrong.steps]
        assert sources.count("mtp") <= 2 + len(sources) // 8, sources  # the first try, then a probe every 8 steps
        # the next reply starts with the side that has been winning (not with another try of the head)
        (choice,) = sess.drafter_choices.values()
        assert choice.best == "policy"
        choice.since_probe = 0  # (no probe due at its first step)
        again = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], record_steps=True, reuse_prefix=False)
        assert again.output_ids == plain.output_ids and again.steps[0]["source"] != "mtp", again.steps[:2]


@pytest.mark.slow  # the hybrid MTP build (shared with the tests above)
def test_the_head_runs_through_the_tensorrt_double_as_on_onnxruntime(mtp_pair, tmp_path, doubles):  # noqa: F811
    """`engine` builds `mtp.plan` with its profile (1-64 new entries, 0..S-1 cached ones), and MTP drafting
    through the TensorRT backend (the test double) equals onnxruntime's step by step."""
    from trt_doubles import GPU, FakeTensorRT

    import runtime
    from dflash_export.trt.engine import build_engines

    _, art, _, _, _ = mtp_pair
    out = tmp_path / "engines"
    shutil.copytree(art, out)
    manifest = build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True)
    assert manifest["trt"]["plans"]["mtp"] == "mtp.plan"
    profile = manifest["trt"]["profiles"]["mtp"][0]
    assert profile["name"] == "mtp" and profile["shapes"]["input_ids"] == [[1], [1], [64]]
    prompt = [9, 80, 4, 41, 17, 3]
    kw = dict(max_new_tokens=24, drafter="mtp", verify_len=3, stop_token_ids=[], record_steps=True)
    with runtime.load(out) as ort_sess, runtime.load(out, backend="trt") as trt_sess:
        assert trt_sess.has_mtp
        a, b = ort_sess.generate(prompt, **kw), trt_sess.generate(prompt, **kw)
        assert b.output_ids == a.output_ids and b.steps == a.steps


@pytest.mark.slow  # the hybrid MTP build (shared with the tests above)
def test_batched_serving_of_an_artifact_with_a_head_stays_exact(mtp_pair):
    """The batched engine serves an artifact with an MTP head (its batched graphs ignore the head): each
    greedy stream equals its one-sequence plain reply, each seeded one its reply alone in the engine (as
    `test_batched_hybrid_engine`: the batched graph samples with its own rounding); `drafter="mtp"` is
    refused by name."""
    import runtime
    from runtime.batching import BatchEngine

    _, art, _, _, _ = mtp_pair
    prompts = [[9, 80, 4, 41, 17, 3], [5, 17, 33], [120, 7, 7, 64, 1, 90, 2], [33, 34]]
    kw = dict(max_new_tokens=16, stop_token_ids=[])
    sampled = dict(temperature=0.8, seed=4)
    with runtime.load(art) as sess:
        greedy = [sess.generate(p, block_size=1, **kw).output_ids for p in prompts]
    with BatchEngine(art, max_batch=1, speculation=False) as engine:
        alone = [engine.generate([p], **kw, **sampled)[0].output_ids for p in prompts]
    with BatchEngine(art, max_batch=4) as engine:
        for case, expected in ((dict(), greedy), (sampled, alone)):
            handles = [engine.stream(p, **kw, **case) for p in prompts]
            for h in handles:
                for _ in h:
                    pass
            assert [h.result.output_ids for h in handles] == expected
        with pytest.raises(DFlashError, match='drafter "mtp" is not supported by the BatchEngine'):
            engine.stream(prompts[0], max_new_tokens=4, drafter="mtp")


@pytest.mark.slow  # the hybrid MTP build (shared with the tests above)
def test_draft_none_builds_the_target_and_its_head_alone(mtp_pair):
    """`build --draft none`: no draft graph or mask row, the target's one tap its final hidden state (no
    second output), proposals as ids; `check` compares the target alone with the reference; auto equals
    plain and drafts with the head; what needs a DFlash draft is refused by name."""
    import json

    import runtime
    from dflash_export.check.parity import run_check

    target, _, _, _, alone = mtp_pair
    manifest = json.loads((alone / "manifest.json").read_text())
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    assert manifest["draft"]["graph"] is None and manifest["mask_embedding"] is None
    assert manifest["draft"]["target_layer_ids"] == [layers - 1]
    assert not (alone / "draft.onnx").exists() and not (alone / "mask_embedding.npy").exists()
    target_io = manifest["io"]["target"]
    assert "proposal_ids" in [i["name"] for i in target_io["inputs"]]
    assert "final_hidden" not in [o["name"] for o in target_io["outputs"]] and "draft" not in manifest["io"]
    report = run_check(alone)
    assert report.passed and {r.case for r in report.results} == {"prefill", "verify", "mtp_prefill", "mtp_step"}, report
    mtp_rows = [r for r in report.results if r.case.startswith("mtp_")]
    assert {r.output for r in mtp_rows} == {"next_ids", "mtp_hidden", "key", "value"}
    prompt = [9, 80, 4, 41, 17, 3]
    with runtime.load(alone) as sess:
        assert sess.graphs == ("target", "mtp")
        plain = sess.generate(prompt, max_new_tokens=24, block_size=1, stop_token_ids=[])
        auto = sess.generate(prompt, max_new_tokens=24, stop_token_ids=[], record_steps=True, reuse_prefix=False)
        assert auto.output_ids == plain.output_ids and "mtp" in [s["source"] for s in auto.steps]
        fixed = sess.generate(prompt, max_new_tokens=24, verify_len=2, stop_token_ids=[], record_steps=True)
        assert fixed.output_ids == plain.output_ids and {s["source"] for s in fixed.steps if s["proposed"]} == {"mtp"}
        with pytest.raises(DFlashError, match='drafter "dflash" needs a DFlash draft'):
            sess.generate(prompt, max_new_tokens=4, drafter="dflash")
        with pytest.raises(DFlashError, match="verify tree"):
            sess.generate(prompt, max_new_tokens=4, verify_len="2x2")


@pytest.mark.slow  # the hybrid MTP build's checkpoint
def test_without_a_known_draft_a_checkpoint_with_a_head_gets_none_and_batched_needs_one(mtp_pair, tmp_path):
    """A checkpoint carrying `mtp.*` and no known DFlash draft gets no draft by default (not an untrained
    one); `--batched --draft none` is one error, before any output exists."""
    from dflash_export.build import BuildOptions, build, prepare_pair

    target = str(mtp_pair[0])
    assert prepare_pair(target, None)[3] is None
    assert prepare_pair(target, None, mtp=False)[3] is not None  # (--no-mtp: the untrained draft, as before)
    with pytest.raises(DFlashError, match="--batched needs a DFlash draft"):
        build(BuildOptions(target, "none", tmp_path / "art", batched=True, quiet=True))
    assert not (tmp_path / "art").exists()


def test_an_mtp_graph_of_another_dtype_than_the_manifest_is_one_clear_error():
    """An `mtp.onnx` swapped in from an fp16 build (a hand-assembled artifact): refused when loaded, as a
    target graph of the wrong dtype is, instead of onnxruntime's type error at the first call."""
    from runtime.backends.ort import check_graph_io

    fp16 = [("input_ids", "tensor(int64)"), ("hidden", "tensor(float16)"), ("past_key", "tensor(float16)"),
            ("past_value", "tensor(float16)")]
    assert check_graph_io("mtp", [(n, t.replace("16", "")) for n, t in fp16], {"dtype": "fp32"}) is None
    with pytest.raises(DFlashError, match=r"mtp graph stores K/V as tensor\(float16\) but the manifest says fp32"):
        check_graph_io("mtp", fp16, {"dtype": "fp32"})
