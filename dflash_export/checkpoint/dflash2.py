"""Reading DFlash 2 draft checkpoints (`DFlash2DraftModel`, z-lab/dflash `model.py` of 2026-08): a DFlash
draft whose layers are wrapped in grouped dynamic convolutions, plus a candidate selector that walks the
block left to right over the top candidates of the target's LM head.

Config: v1's fields plus `dflash_config.conv_kernel_size`, `conv_group_size`, `selector_rank`,
`selector_top_k` and the optional `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`
(each read from `dflash_config`, else from the top level, as the reference reads them).
Weights: v1's plus, per layer, `attention_conv` / `mlp_conv` (`base_kernel [2, K, d]`,
`kernel_projection.weight [2 K d / G, d]`) and `candidate_selector.hidden_projection.weight [r, d]`,
`candidate_selector.predecessor_codebook` / `successor_codebook` `[V, r]` (stored without `.weight`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_export.checkpoint.draft import (
    DraftSpec,
    check_draft_weights,
    draft_weight_shapes,
    parse_draft_config,
    read_draft_checkpoint,
)
from dflash_export.checkpoint.target import TargetSpec
from runtime.errors import DFlashError

ARCHITECTURE = "DFlash2DraftModel"
SELECTOR = "candidate_selector."


@dataclass(frozen=True)
class DFlash2Spec(DraftSpec):
    """A validated DFlash 2 checkpoint: a :class:`DraftSpec` plus the convolution and selector sizes.

    Attributes:
        conv_kernel_size: taps of each dynamic convolution (tap 0: the row itself, tap t: t rows back).
        conv_group_size: channels sharing one dynamic coefficient (divides hidden_size).
        selector_rank: r, the width of the selector's codebooks.
        selector_top_k: candidates per block position (the LM head's top k).
        input_embedding_scale: factor on the block's target embeddings.
        output_multiplier: factor on the LM head's logits.
        final_logit_softcapping: c > 0: logits become c * tanh(logits / c); None: not capped.
        vocab_size: V, the target's vocabulary (the codebooks' rows).
    """

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    vocab_size: int = 0

    proposes_itself = True

    def manifest_fields(self) -> dict[str, Any]:
        """v1's fields plus the family and what its selector and convolutions are."""
        return {**super().manifest_fields(), "family": "dflash2",
                "selector": {"rank": self.selector_rank, "top_k": self.selector_top_k, "walk": "in the draft graph"},
                "conv": {"kernel_size": self.conv_kernel_size, "group_size": self.conv_group_size},
                "input_embedding_scale": self.input_embedding_scale, "output_multiplier": self.output_multiplier,
                "final_logit_softcapping": self.final_logit_softcapping}


def _field(cfg: dict, name: str, default=None):
    """`dflash_config[name]`, else the config's top-level `name` (the reference's `_draft_value`)."""
    dcfg = cfg.get("dflash_config") or {}
    return dcfg[name] if name in dcfg else cfg.get(name, default)


def _positive_int(value, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DFlashError(f"draft {where}: dflash_config.{name} {value!r} must be a positive integer")
    return value


# Beyond this magnitude a scale overflows fp16 activations (and fp32 logits soon after): every proposal NaN
SCALE_LIMIT = 1e4


def _number(value, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DFlashError(f"draft {where}: {name} {value!r} must be a finite number")
    if abs(value) > SCALE_LIMIT:
        raise DFlashError(f"draft {where}: {name} {value!r} is beyond +-{SCALE_LIMIT:g}: the graph's activations would "
                          "overflow (every proposal NaN); check the config")
    return float(value)


def parse_dflash2_config(cfg: dict[str, Any], target: TargetSpec, where: str, fc_in_features: int | None) -> DFlash2Spec:
    """Validate a DFlash 2 config dict against its target (v1's checks, `parse_draft_config`, plus the
    convolution and selector fields).

    Raises:
        DFlashError: any v1 problem; a missing or non-positive conv or selector size; a group size that
            does not divide hidden_size; selector_top_k above the vocabulary.
    """
    base = parse_draft_config(cfg, target, where, fc_in_features, architecture=ARCHITECTURE)
    names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    missing = [name for name in names if _field(cfg, name) is None]
    if missing:
        raise DFlashError(f"draft {where} is a {ARCHITECTURE} but its dflash_config lacks {missing}; "
                          "it is not a complete DFlash 2 config")
    sizes = {name: _positive_int(_field(cfg, name), name, where) for name in names}
    d = base.arch.hidden_size
    if d % sizes["conv_group_size"]:
        raise DFlashError(f"draft {where}: conv_group_size {sizes['conv_group_size']} does not divide hidden_size {d}")
    if sizes["selector_top_k"] > target.vocab_size:
        raise DFlashError(f"draft {where}: selector_top_k {sizes['selector_top_k']} exceeds the target vocabulary "
                          f"({target.vocab_size})")
    softcap = _field(cfg, "final_logit_softcapping")
    softcap = None if softcap is None else _number(softcap, "final_logit_softcapping", where)
    return DFlash2Spec(**base.__dict__, **sizes,
                       input_embedding_scale=_number(_field(cfg, "input_embedding_scale", 1.0), "input_embedding_scale", where),
                       output_multiplier=_number(_field(cfg, "output_multiplier", 1.0), "output_multiplier", where),
                       final_logit_softcapping=_softcap(softcap, where),
                       vocab_size=target.vocab_size)


def _softcap(cap: float | None, where: str) -> float | None:
    """The soft cap, None when off (<= 0, as the reference); a positive cap below 1e-3 would zero every logit."""
    if cap is None or cap <= 0:
        return None
    if cap < 1e-3:
        raise DFlashError(f"draft {where}: final_logit_softcapping {cap!r} would squash every logit to 0; "
                          "use a cap of at least 1e-3, or 0 (off)")
    return cap


def dflash2_weight_shapes(spec: DFlash2Spec) -> dict[str, tuple[int, ...]]:
    """Expected shape of every DFlash 2 weight: v1's (`draft_weight_shapes`) plus the convolutions and
    the selector (81 tensors for a 5-layer release)."""
    d, k, groups = spec.arch.hidden_size, spec.conv_kernel_size, spec.arch.hidden_size // spec.conv_group_size
    shapes = draft_weight_shapes(spec, d)
    for i in range(spec.arch.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, d)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * groups, d)
    shapes[SELECTOR + "hidden_projection.weight"] = (spec.selector_rank, d)
    shapes[SELECTOR + "predecessor_codebook"] = (spec.vocab_size, spec.selector_rank)
    shapes[SELECTOR + "successor_codebook"] = (spec.vocab_size, spec.selector_rank)
    return shapes


def load_dflash2_spec(draft_dir: Path, target: TargetSpec) -> tuple[DFlash2Spec, dict[str, torch.Tensor]]:
    """Validate a DFlash 2 draft directory and load its weights (a leading "model." is stripped; codebooks
    stored with a `.weight` suffix, as transformers' key mapping writes them, are renamed back).

    Raises:
        DFlashError: see :func:`parse_dflash2_config`; missing, misshapen or non-finite weights.
    """
    draft_dir = Path(draft_dir)
    cfg, state = read_draft_checkpoint(draft_dir)
    for name in ("predecessor_codebook", "successor_codebook"):
        if SELECTOR + name + ".weight" in state and SELECTOR + name in state:
            raise DFlashError(f"draft {draft_dir} holds both {SELECTOR + name} and {SELECTOR + name}.weight; "
                              "keep one of the two (the same codebook, two spellings)")
        if SELECTOR + name + ".weight" in state:
            state[SELECTOR + name] = state.pop(SELECTOR + name + ".weight")
    spec = parse_dflash2_config(cfg, target, str(draft_dir), int(state["fc.weight"].shape[1]))
    spec = DFlash2Spec(**{**spec.__dict__, "path": draft_dir})
    rows = getattr(state.get(SELECTOR + "predecessor_codebook"), "shape", (target.vocab_size,))[0]
    if rows != target.vocab_size:
        raise DFlashError(f"draft {draft_dir}: its codebooks have {rows} rows but the target's vocabulary has "
                          f"{target.vocab_size} ids; this draft belongs to another target")
    check_draft_weights(spec, state, str(draft_dir), dflash2_weight_shapes(spec))
    return spec, state
