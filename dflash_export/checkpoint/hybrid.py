"""Qwen3.5 / Qwen3.6 hybrid targets: recognising and validating their checkpoints.

A `Qwen3_5ForCausalLM` checkpoint holds its text model at the top level; a
`Qwen3_5ForConditionalGeneration` one (the multimodal releases) holds the same text model under
`text_config` and `model.language_model.*`, next to a vision tower this project does not export.
Three of every four layers are Gated DeltaNet (`linear_attention`) layers with a constant-size
recurrent state; every `full_attention_interval`-th is a gated full-attention layer with partial RoPE
(transformers 5.24, `models/qwen3_5`). Mixture-of-experts variants (`Qwen3_5Moe*`) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_export.checkpoint.target import AttentionSpec
from runtime.errors import DFlashError

LAYER_TYPES = ("linear_attention", "full_attention")

HYBRID_ARCHITECTURES = {"Qwen3_5ForCausalLM": "causal_lm", "Qwen3_5ForConditionalGeneration": "conditional_generation"}
HYBRID_MODEL_TYPES = {"qwen3_5": "conditional_generation", "qwen3_5_text": "causal_lm"}
MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


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
class HybridSpec:
    """Sizes of a Qwen3.5 text stack, read from `config.json` (its `text_config` when nested).

    Attributes:
        layer_types: per layer, "linear_attention" (GDN) or "full_attention".
        num_heads / num_kv_heads / head_dim: full-attention GQA layout.
        rotary_dim: leading head dims that RoPE rotates (`partial_rotary_factor * head_dim`).
        conv_kernel: GDN depthwise conv width K (the conv state holds K - 1 rows).
        num_k_heads / num_v_heads / key_head_dim / value_head_dim: GDN head layout.
        raw: the text config dict.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    attention_bias: bool
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int
    tie_word_embeddings: bool
    raw: dict[str, Any] = field(repr=False, hash=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv: q, k (num_k_heads x key_head_dim each) and v."""
        return 2 * self.num_k_heads * self.key_head_dim + self.num_v_heads * self.value_head_dim

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = "Qwen3.5 config") -> "HybridSpec":
        """From a `Qwen3_5ForCausalLM` or `Qwen3_5ForConditionalGeneration` config dict.

        Raises:
            DFlashError: a missing field, an unknown layer type or a RoPE type other than default.
        """
        text = cfg.get("text_config") or cfg
        rope = dict(text.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise DFlashError(f"{where}: RoPE type {rope['rope_type']!r} is not supported (only default)")
        try:
            heads, head_dim = int(text["num_attention_heads"]), int(text.get("head_dim") or 256)
            n = int(text["num_hidden_layers"])
            interval = int(text.get("full_attention_interval", 4))
            types = tuple(text.get("layer_types") or [
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)])
            # as HF: partial_rotary_factor defaults to 0.25, top level in older configs
            factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
            spec = cls(
                vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
                intermediate_size=int(text["intermediate_size"]), layer_types=types, num_heads=heads,
                num_kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                rotary_dim=int(head_dim * factor), attention_bias=bool(text.get("attention_bias", False)),
                conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
                num_k_heads=int(text.get("linear_num_key_heads", 16)),
                num_v_heads=int(text.get("linear_num_value_heads", 32)),
                key_head_dim=int(text.get("linear_key_head_dim", 128)),
                value_head_dim=int(text.get("linear_value_head_dim", 128)),
                # the top-level flag governs a ConditionalGeneration checkpoint's head
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                raw=text,
            )
        except KeyError as exc:
            raise DFlashError(f"{where} config.json lacks the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise DFlashError(f"{where} config.json has a field of the wrong type ({exc})") from None
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad or len(types) != n or "full_attention" not in types:
            raise DFlashError(f"{where}: layer_types {list(types)} must list {n} layers of {LAYER_TYPES}, "
                              "one full_attention at least (positions come from its past length)")
        if min(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.num_k_heads, spec.num_v_heads, spec.key_head_dim,
               spec.value_head_dim, spec.conv_kernel - 1, spec.vocab_size) < 1:
            raise DFlashError(f"{where} config.json has a non-positive size field")
        if spec.num_v_heads % spec.num_k_heads:
            raise DFlashError(f"{where}: linear_num_value_heads {spec.num_v_heads} is not a multiple of "
                              f"linear_num_key_heads {spec.num_k_heads}")
        if spec.num_heads % spec.num_kv_heads or spec.rotary_dim % 2 or spec.rotary_dim < 2:
            raise DFlashError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads and "
                              "partial_rotary_factor * head_dim an even number >= 2")
        return spec

    def attention_spec(self) -> AttentionSpec:
        """The full-attention layers' sizes as `nn.layers.Attention` takes them."""
        return AttentionSpec(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=self.attention_bias, mlp_bias=False, raw=self.raw)




def parse_hybrid_config(cfg: dict[str, Any], kind: str, where: str) -> HybridSpec:
    """Validate a dense Qwen3.5/3.6 config (`hybrid_kind` not None): `HybridSpec.from_config`.

    Raises:
        DFlashError: a missing or malformed field, named.
    """
    if kind == "conditional_generation" and not isinstance(cfg.get("text_config"), dict):
        raise DFlashError(f"{where} is a Qwen3_5ForConditionalGeneration checkpoint without a text_config object")
    return HybridSpec.from_config(cfg, where)
