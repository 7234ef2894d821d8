"""Tiny Hugging Face targets and DFlash drafts written to disk, for tests (no network, seconds to build)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96


def make_target(
    out: Path,
    family: str = "qwen3",
    tie: bool = False,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 24,
    rope_theta: float = 10000.0,
    seed: int = 0,
    vocab: int = VOCAB,
    **extra,
) -> Path:
    """Save a random tiny Qwen3ForCausalLM or LlamaForCausalLM (safetensors) plus a tokenizer-free config.

    head_dim defaults to 24 != hidden / heads (= 16) and GQA 4:2, the cases that break naive exporters.
    """
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie,
        rope_theta=rope_theta,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.eval()
    # Larger-than-default weights make logits less tied, so greedy argmax comparisons are meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def make_draft(
    out: Path,
    target_dir: Path,
    layers: int = 2,
    block_size: int = 8,
    mask_token_id: int = VOCAB - 1,
    taps: list[int] | None = None,
    rope_theta: float = 500000.0,
    seed: int = 1,
    block_in_dflash_config: bool = False,
    scale: float = 0.05,
    **overrides,
) -> Path:
    """Save a random DFlash draft in the released checkpoint format for the target at `target_dir`.

    Its rope_theta (500000) deliberately differs from the target's (10000). `overrides` patch the config.
    """
    from safetensors.torch import save_file

    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.draft import draft_weight_shapes, parse_draft_config

    tspec = load_target_spec(target_dir)
    a = tspec.arch
    taps = taps if taps is not None else [1, a.num_layers - 1]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "num_target_layers": a.num_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps},
        "hidden_size": a.hidden_size,
        "intermediate_size": 2 * a.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-6,
        "vocab_size": tspec.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
    }
    if block_in_dflash_config:
        cfg["dflash_config"]["block_size"] = block_size
    else:
        cfg["block_size"] = block_size
    cfg.update(overrides)
    spec = parse_draft_config(cfg, tspec, "tiny", None)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in draft_weight_shapes(spec, a.hidden_size).items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = scale * torch.randn(shape, generator=gen)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def record_weight_reads(monkeypatch) -> list[tuple[str, bool]]:
    """Record every weight a build reads from its source: (name, read while a graph file was being
    written). Streamed export reads matrices only while writing; this is what tests check it with."""
    from dflash_export.export import graphs as export_mod
    from dflash_export.checkpoint import weights as weights_mod

    reads, saving = [], [False]
    original_read, original_save = weights_mod.WeightSource.read_as, export_mod.save_graph

    def read_as(self, name, dt):
        reads.append((name, saving[0]))
        return original_read(self, name, dt)

    def save_graph(model, path, progress=False):
        saving[0] = True
        try:
            original_save(model, path, progress)
        finally:
            saving[0] = False

    monkeypatch.setattr(weights_mod.WeightSource, "read_as", read_as)
    monkeypatch.setattr(export_mod, "save_graph", save_graph)
    return reads


def make_dflash2_draft(
    out: Path,
    target_dir: Path,
    layers: int = 2,
    block_size: int = 8,
    mask_token_id: int = VOCAB - 1,
    taps: list[int] | None = None,
    seed: int = 2,
    scale: float = 0.15,
    rank: int = 32,
    top_k: int = 8,
    group: int = 16,
    dflash_config: dict | None = None,
    state_fn=None,
    **overrides,
) -> Path:
    """Save a random DFlash 2 draft in the released format (z-lab/dflash's `dflash2-config.json` and its
    81-tensor header for 5 layers: per layer v1's 13 plus `attention_conv` / `mlp_conv` `base_kernel`
    and `kernel_projection.weight`; the selector's `hidden_projection.weight` and its two codebooks,
    stored without `.weight`). All layers sliding (window 2048), `is_causal: false`, as released.
    `dflash_config` entries and `overrides` patch the config; `state_fn(state, cfg)` may edit the weights."""
    from safetensors.torch import save_file

    from dflash_export.families.registry import load_target_spec

    tspec = load_target_spec(target_dir)
    a = tspec.arch
    d = a.hidden_size
    taps = taps if taps is not None else [1, a.num_layers - 1]
    dcfg = {"block_size": block_size, "conv_group_size": group, "conv_kernel_size": 2, "mask_token_id": mask_token_id,
            "selector_rank": rank, "selector_top_k": top_k, "target_layer_ids": taps, **(dflash_config or {})}
    cfg = {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "is_causal": False, "dflash_config": dcfg,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": d, "intermediate_size": 2 * d,
        "layer_types": ["sliding_attention"] * layers, "max_window_layers": layers, "model_type": "qwen3",
        "num_attention_heads": 4, "num_hidden_layers": layers, "num_key_value_heads": 2,
        "num_target_layers": a.num_layers, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "sliding_window": 2048,
        "tie_word_embeddings": False, "use_sliding_window": True, "vocab_size": tspec.vocab_size,
    }
    cfg.update(overrides)
    from dflash_export.checkpoint.dflash2 import dflash2_weight_shapes, parse_dflash2_config

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in dflash2_weight_shapes(parse_dflash2_config(cfg, tspec, "tiny", None)).items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("base_kernel"):  # tap 0 near 1 (the row itself), tap 1 small
            state[name] = 0.2 * torch.randn(shape, generator=gen)
            state[name][:, 0] += 1.0
        elif name.endswith("kernel_projection.weight"):  # small dynamic coefficients
            state[name] = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("codebook"):
            state[name] = torch.randn(shape, generator=gen)
        else:
            state[name] = scale * torch.randn(shape, generator=gen)
    if state_fn is not None:
        state = state_fn(state, cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
