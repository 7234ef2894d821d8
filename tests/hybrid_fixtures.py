"""A tiny random Qwen3.5 hybrid for the tests (3 Gated DeltaNet layers, then 1 full-attention layer:
its caches are past_key_3 / past_value_3), and an oracle draft that makes speculation accept and
reject blocks on purpose. The artifact is built once per test run (`hybrid_pair` in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 256
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              tie_word_embeddings=True, eos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


# six layers whose first attention layer is not the replication template's (layer 1)
SIX_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention"] * 2
# two Gated DeltaNet layers and an attention layer: the batched tests' hybrid (every kind of cache, two
# recurrent states per slot, at two thirds of the tracing cost of the 4-layer one)
THREE_LAYER_TYPES = SIX_LAYER_TYPES[:3]


def six_layer_model(layer_types=SIX_LAYER_TYPES):
    """A seeded random Qwen3_5ForCausalLM of `layer_types` (default 6 layers, `SIX_LAYER_TYPES`) with distinct
    norms, conv kernels and decays per layer (zero-centred norms start at zero: each layer gets its own)."""
    import torch
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen3_5TextConfig(**{**CONFIG, "num_hidden_layers": len(layer_types), "layer_types": list(layer_types)})
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    return model


def untrained_draft_dir(target_dir, out) -> None:
    """Write the deterministic untrained DFlash draft of `target_dir` as a draft directory (a checkpoint
    with an MTP head gets no draft unless one is named)."""
    import json

    from safetensors.torch import save_file

    from dflash_export.checkpoint.sources import random_draft_config
    from dflash_export.drafts import dflash
    from dflash_export.families.registry import load_target_spec

    tspec = load_target_spec(target_dir)
    _, state = dflash.untrained_draft(tspec)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(random_draft_config(tspec)))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))


def save_with_random_mtp_head(model, target_dir) -> None:
    """Save `model` (a Qwen3_5ForCausalLM with tied embeddings) to `target_dir` with a seeded random
    `mtp.*` head of its shape in the checkpoint."""
    import torch
    from safetensors.torch import save_file

    from dflash_export.checkpoint.hybrid import HybridSpec
    from dflash_export.nn.mtp import MTPHead

    model.save_pretrained(target_dir, safe_serialization=True)
    torch.manual_seed(2)
    head = MTPHead(HybridSpec.from_config(model.config.to_dict()))
    mtp = {f"mtp.{k}": v.detach().clone().contiguous() for k, v in head.state_dict().items() if not k.startswith("model.")}
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # (tied)
    save_file({**state, **mtp}, str(target_dir / "model.safetensors"), metadata={"format": "pt"})


@dataclass
class HybridPair:
    model: object  # the transformers Qwen3_5ForCausalLM (eager attention), the numerical reference
    target_dir: Path  # its safetensors checkpoint
    artifact: Path  # `build` of it with an untrained draft, fp32, max_seq_len 256
    reads: dict  # checkpoint tensor name -> times `build` read it (WeightSource.read)
    streamed: list  # the target weights `build` streamed (placeholders until written)


# this model's weights are small: below this many elements `build` would load every one at once
# (weights.STREAM_MIN_ELEMENTS); the fixture's build lowers the threshold so it streams most of them
TEST_STREAM_MIN_ELEMENTS = 4096


def make_hybrid(tmp_path_factory) -> HybridPair:
    """A seeded random Qwen3_5ForCausalLM saved under `root/target` and built into `root/artifact`, once
    per test run (`shared_cache.shared_dir`: the first xdist worker builds, the others read). The build's
    weight reads are kept in `root/build_reads.json`; every worker loads the model from the checkpoint."""
    import json

    import torch
    import transformers
    from shared_cache import shared_dir

    def make(root: Path) -> None:
        torch.manual_seed(0)
        cfg = transformers.Qwen3_5TextConfig(**CONFIG)
        cfg._attn_implementation = "eager"
        model = transformers.Qwen3_5ForCausalLM(cfg).eval()
        with torch.no_grad():  # larger weights than the init: every part of the layers must matter
            for name, p in model.named_parameters():
                if p.ndim == 2 and "embed" not in name:
                    p.mul_(3.0)
        model.save_pretrained(root / "target", safe_serialization=True)
        reads, streamed = streamed_build(root / "target", root / "artifact")
        (root / "build_reads.json").write_text(json.dumps({"reads": reads, "streamed": streamed}))

    root = shared_dir(tmp_path_factory, "qwen3_5_hybrid", make)
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(root / "target", dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    recorded = json.loads((root / "build_reads.json").read_text())
    return HybridPair(model, root / "target", root / "artifact", recorded["reads"], recorded["streamed"])


def streamed_build(target: Path, out: Path) -> tuple[dict, list]:
    """`build` of `target` (untrained draft, fp32, max_seq_len 256) with the streaming threshold at
    TEST_STREAM_MIN_ELEMENTS; returns (reads per checkpoint tensor, the target weights bound as streamed)."""
    from collections import Counter
    from unittest import mock

    from dflash_export.build import BuildOptions, build
    from dflash_export.checkpoint import weights

    reads, streamed = Counter(), []
    read, bind = weights.WeightSource.read, weights.bind_weights

    def counting_read(self, name):
        reads[name] += 1
        return read(self, name)

    def recording_bind(module, source, where, *args):
        readers = bind(module, source, where, *args)
        if where.startswith("target"):
            streamed.extend(readers)
        return readers

    with mock.patch.object(weights, "STREAM_MIN_ELEMENTS", TEST_STREAM_MIN_ELEMENTS), \
            mock.patch.object(weights.WeightSource, "read", counting_read), \
            mock.patch("dflash_export.families.dense.bind_weights", recording_bind):
        build(BuildOptions(str(target), None, out, max_seq_len=256, quiet=True))
    return dict(reads), streamed


def oracle_draft(sess, reference: list[int], wrong: float) -> None:
    """Replace the session's draft call: it proposes the reference continuation (a proposing draft's
    top-1 ids; else hidden rows that make the target's tied head propose it: the wanted token's
    embedding row, scaled), except that a seeded fraction `wrong` of the proposals is another token,
    so blocks are accepted whole and rejected part-way."""
    table = None if sess.draft_proposes else embedding_table(sess).astype(np.float32)
    rng = np.random.default_rng(0)

    def run_draft(n_context, past, block_size, taps_row=0, rows=None):
        start = len(sess.context.ids) + 1  # proposal 1 is the token after the anchor
        rows = []
        for j in range(block_size - 1):
            pos = start + j
            token = reference[pos] if pos < len(reference) else 0
            if rng.random() < wrong:
                token = (token + 1) % VOCAB
            rows.append(token)
        n, ids = block_size - 1, np.array(rows, dtype=np.int64)
        if sess.draft_proposes:
            ranks = sess.proposal_ranks
            top = (ids[:, None] + np.arange(ranks, dtype=np.int64)) % VOCAB  # rank 0 the wanted token
            sess.backend.write(sess.draft_top_ids.rows(0, n), top)
            sess.backend.write(sess.draft_top_probs.rows(0, n), np.tile(np.float32(0.9) ** np.arange(1, ranks + 1), (n, 1)))
        else:
            sess.backend.write(sess.draft_hidden.rows(0, n), (table[ids] * 20.0).astype(sess.dtype))
    sess.run_draft = run_draft


def embedding_table(sess) -> np.ndarray:
    """The target graph's `[VOCAB, hidden]` embedding initializer."""
    import onnx
    from onnx import numpy_helper

    for init in onnx.load(str(sess.artifact_dir / "target.onnx")).graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.shape == (VOCAB, CONFIG["hidden_size"]):
            return arr
    raise AssertionError("no embedding table in the target graph")


def batched_hybrid_artifact(tmp_path_factory) -> Path:
    """The 3-layer hybrid (`THREE_LAYER_TYPES`, `six_layer_model`'s weights) with a random draft tapping
    every layer whose proposal vocabulary is every id (so its graph proposes ids and batched steps can
    speculate), built with `--batched` once per test run: test_batched_hybrid_engine.py runs it, and
    test_batched_hybrid.py compares its batched target graph with the module."""
    import json

    import tiny_models
    from shared_cache import shared_dir

    from dflash_export.build import BuildOptions, build

    def make(d: Path) -> None:
        six_layer_model(THREE_LAYER_TYPES).save_pretrained(d / "target", safe_serialization=True)
        draft = tiny_models.make_draft(d / "draft", d / "target", mask_token_id=VOCAB - 1, scale=0.15, taps=[0, 1, 2])
        (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(VOCAB))}))
        build(BuildOptions(str(d / "target"), str(draft), d / "artifact", max_seq_len=160, batched=True, quiet=True))

    return shared_dir(tmp_path_factory, "batched_hybrid", make) / "artifact"
