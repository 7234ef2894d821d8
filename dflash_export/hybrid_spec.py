"""Qwen3.5 / Qwen3.6 hybrid targets: recognising and validating their checkpoints.

A `Qwen3_5ForCausalLM` checkpoint holds its text model at the top level; a
`Qwen3_5ForConditionalGeneration` one (the multimodal releases) holds the same text model under
`text_config` and `model.language_model.*`, next to a vision tower this project does not export.
Three of every four layers are Gated DeltaNet (`linear_attention`) layers with a constant-size
recurrent state; every `full_attention_interval`-th is a gated full-attention layer with partial RoPE
(transformers 5.24, `models/qwen3_5`). Mixture-of-experts variants (`Qwen3_5Moe*`) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checkpoint import AttentionSpec
from runtime.errors import DFlashError

HYBRID_ARCHITECTURES = {"Qwen3_5ForCausalLM": "causal_lm", "Qwen3_5ForConditionalGeneration": "conditional_generation"}
HYBRID_MODEL_TYPES = {"qwen3_5": "conditional_generation", "qwen3_5_text": "causal_lm"}
MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


def hybrid_kind(cfg: dict[str, Any]) -> str | None:
    """"causal_lm" or "conditional_generation" for a dense Qwen3.5/3.6 config, None for any other.

    Raises:
        DFlashError: a mixture-of-experts Qwen3.5/3.6 checkpoint (not supported: say so, not "unknown").
    """
    archs = cfg.get("architectures") or []
    if any(a in MOE_ARCHITECTURES for a in archs) or cfg.get("model_type") in MOE_MODEL_TYPES:
        raise DFlashError(
            "this is a mixture-of-experts Qwen3.5/3.6 checkpoint (e.g. 35B-A3B); dflash_export exports the dense "
            "hybrid targets only (Qwen3.5-4B, 9B, 27B, Qwen3.6-27B)"
        )
    kind = next((HYBRID_ARCHITECTURES[a] for a in archs if a in HYBRID_ARCHITECTURES), None)
    return kind or HYBRID_MODEL_TYPES.get(cfg.get("model_type", ""))


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Sizes of the Gated DeltaNet (linear-attention) layers.

    Attributes:
        num_key_heads / key_head_dim: q and k heads (L2-normalised) and their width d_k.
        num_value_heads / value_head_dim: v heads and their width d_v; key heads are shared by
            `num_value_heads // num_key_heads` consecutive value heads.
        conv_kernel: depthwise causal conv width; the conv state keeps `conv_kernel - 1` rows.
    """

    num_key_heads: int
    key_head_dim: int
    num_value_heads: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (q, k and v projections together)."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def state_elements(self) -> int:
        """Elements of one layer's fp32 recurrent state `[Hv, d_k, d_v]`."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True)
class HybridSpec:
    """A validated dense Qwen3.5/3.6 text model.

    Attributes:
        kind: "causal_lm" (weights `model.*`) or "conditional_generation" (`model.language_model.*`).
        attention: sizes of the stack; its head fields describe the full-attention layers.
        gdn: sizes of the Gated DeltaNet layers.
        layer_types: per layer, "linear_attention" or "full_attention".
        partial_rotary_factor: fraction of each attention head's dims that RoPE rotates.
        vocab_size / tie_word_embeddings: LM head.
    """

    kind: str
    attention: AttentionSpec
    gdn: GatedDeltaNetSpec
    layer_types: tuple[str, ...]
    partial_rotary_factor: float
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def weight_prefix(self) -> str:
        """Where the text model's weights live in the checkpoint."""
        return "model.language_model." if self.kind == "conditional_generation" else "model."


def _text_config(cfg: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    if kind == "causal_lm":
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise DFlashError(f"{where} is a Qwen3_5ForConditionalGeneration checkpoint without a text_config object")
    return {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **text}


def _layer_types(text: dict[str, Any], layers: int, where: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
        interval = int(text.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise DFlashError(f"{where}: layer_types must list {layers} entries of {', '.join(LAYER_TYPES)}")
    return tuple(types)


def parse_hybrid_config(cfg: dict[str, Any], kind: str, where: str) -> HybridSpec:
    """Validate a dense Qwen3.5/3.6 config (`hybrid_kind` not None).

    Raises:
        DFlashError: a missing or malformed field, named.
    """
    text = _text_config(cfg, kind, where)
    attention = AttentionSpec.from_config(text, where)
    try:
        gdn = GatedDeltaNetSpec(
            num_key_heads=int(text["linear_num_key_heads"]), key_head_dim=int(text["linear_key_head_dim"]),
            num_value_heads=int(text["linear_num_value_heads"]), value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        )
        rope = text.get("rope_parameters") or {}
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        vocab = int(text["vocab_size"])
    except KeyError as exc:
        raise DFlashError(f"{where} config.json lacks the field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise DFlashError(f"{where} config.json has a field of the wrong type ({exc})") from None
    if min(gdn.num_key_heads, gdn.key_head_dim, gdn.num_value_heads, gdn.value_head_dim, gdn.conv_kernel - 1, vocab) < 1:
        raise DFlashError(f"{where} config.json has a non-positive Gated DeltaNet size")
    if gdn.num_value_heads % gdn.num_key_heads:
        raise DFlashError(f"{where}: linear_num_value_heads {gdn.num_value_heads} is not a multiple of "
                          f"linear_num_key_heads {gdn.num_key_heads}")
    if not 0.0 < partial <= 1.0 or int(partial * attention.head_dim) % 2:
        raise DFlashError(f"{where}: partial_rotary_factor {partial} must rotate an even number of the "
                          f"{attention.head_dim} head dims")
    return HybridSpec(kind=kind, attention=attention, gdn=gdn,
                      layer_types=_layer_types(text, attention.num_layers, where), partial_rotary_factor=partial,
                      vocab_size=vocab, tie_word_embeddings=bool(text.get("tie_word_embeddings", False)))


def refuse_until_exportable(spec: HybridSpec, where: str) -> None:
    """The hybrid target is recognised and valid, but `build` cannot export it yet: say exactly that."""
    n_gdn = spec.layer_types.count("linear_attention")
    raise DFlashError(
        f"{where} is a Qwen3.5/3.6 hybrid target ({n_gdn} Gated DeltaNet + {len(spec.layer_types) - n_gdn} "
        "full-attention layers); its graph export and the runtime's recurrent-state rollback are not "
        "implemented yet, so build refuses it (supported now: Qwen3ForCausalLM, LlamaForCausalLM)"
    )
