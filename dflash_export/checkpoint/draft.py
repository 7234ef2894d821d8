"""Reading and validating DFlash draft checkpoints (dflash-facts section 4): the draft's own sizes,
block size, mask id and tap layers, its proposal vocabulary, and its weights against its config.

As for targets (`checkpoint/target.py`), only `config.json`, `draft_vocab.json` and safetensors files are read;
every check raises :class:`runtime.errors.DFlashError` naming the problem and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_export.checkpoint.target import (
    AttentionSpec,
    TargetSpec,
    check_layer_types,
    load_state_dict,
    read_config,
)
from runtime.errors import DFlashError

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class DraftSpec:
    """A validated DFlash draft checkpoint (dflash-facts section 4).

    Attributes:
        path: local directory (None for an in-memory random draft).
        arch: the draft's own sizes and RoPE (never the target's).
        block_size: tokens per block (the anchor plus block_size - 1 masks).
        mask_token_id: id whose target embedding fills masked positions (from the DRAFT config).
        target_layer_ids: tap layers; feature of id L = output of target decoder layer L.
        taps_declared: False when the ids came from the reference fallback rule.
        draft_vocab: sorted target token ids the draft proposes from (its `draft_vocab.json`, written
            by `train-draft`), or None for the full vocabulary.
        layer_types: per draft layer, "full_attention" or "sliding_attention" (Qwen3.6 drafts mix
            them); all full_attention when not given.
        sliding_window: the window W of the sliding layers, from the RAW config's `sliding_window`
            (a block query at position i sees a key at position j only when |i - j| < W, as
            flash-attention's `window_size=(W - 1, W - 1)` in the reference); None without sliding layers.
        causal_layers: per draft layer, whether a block position sees only the block positions up to
            itself (and every context row); the rule of the reference's newest `model.py`: a
            sliding_attention layer is causal unless the config sets `is_causal`, which otherwise decides
            for every layer (`block_attention_rule`). All False (bidirectional) when not given.
    """

    path: Path | None
    arch: AttentionSpec
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    taps_declared: bool
    draft_vocab: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    causal_layers: tuple[bool, ...] = ()

    # the draft graph ranks its own proposals (a selector draft; `families.registry.draft_proposes`)
    proposes_itself = False

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.arch.num_layers)
        if not self.causal_layers:
            object.__setattr__(self, "causal_layers", (False,) * self.arch.num_layers)
        if len(self.causal_layers) != self.arch.num_layers:
            raise ValueError(f"{len(self.causal_layers)} causal flags for {self.arch.num_layers} draft layers")
        if len(self.layer_types) != self.arch.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.arch.num_layers} draft layers")
        if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding_attention layers need a positive sliding_window, not {self.sliding_window!r}")

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types

    def manifest_fields(self) -> dict[str, Any]:
        """What the manifest's draft section records about the layers: how block positions see each
        other per layer (`block_attention`, and the rule that gave it), plus `layer_types` and
        `sliding_window` for a draft with sliding layers."""
        fields: dict[str, Any] = {
            "block_attention": ["causal" if c else "bidirectional" for c in self.causal_layers],
            "block_attention_rule": BLOCK_ATTENTION_RULE,
        }
        if self.has_sliding_layers:
            fields.update({"layer_types": list(self.layer_types), "sliding_window": self.sliding_window})
        return fields


BLOCK_ATTENTION_RULE = ("z-lab/dflash model.py (2026-08): config.is_causal decides for every layer when set; "
                        "otherwise sliding_attention layers are causal inside the block, full_attention layers bidirectional")


def block_causality(cfg: dict[str, Any], layer_types: tuple[str, ...], where: str) -> tuple[bool, ...]:
    """Per layer, whether block positions attend causally to each other (see `BLOCK_ATTENTION_RULE`).

    Raises:
        DFlashError: `is_causal` present but not a boolean or null.
    """
    flag = cfg.get("is_causal")
    if flag is not None and not isinstance(flag, bool):
        raise DFlashError(f"draft {where}: is_causal {flag!r} must be true, false or absent")
    return tuple((t == SLIDING) if flag is None else flag for t in layer_types)


def draft_layer_types(cfg: dict[str, Any], where: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """The draft's per-layer attention types and sliding window, from its RAW config dict.

    `layer_types` as listed; without it, transformers' Qwen3 rule: layers i >= `max_window_layers`
    (default 28) slide when `use_sliding_window` is set. The window is the raw `sliding_window`:
    transformers' Qwen3Config drops it unless `use_sliding_window` is set, so it is never read from
    a config object.

    Returns:
        (layer types, window or None when no layer slides).

    Raises:
        DFlashError: unknown layer types, a list of the wrong length, a sliding layer without a
            positive integer `sliding_window`.
    """
    check_layer_types(cfg, f"draft {where}", draft=True)
    types = cfg.get("layer_types")
    if types is None:
        # transformers: an absent sliding_window defaults (4096), an explicit null turns the window off
        slide = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window", 0) is not None
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise DFlashError(f"draft {where}: max_window_layers {first!r} must be an integer")
        types = [SLIDING if slide and i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise DFlashError(f"draft {where}: layer_types lists {len(types)} layers but num_hidden_layers is {num_layers}")
    types = tuple(types)
    if SLIDING not in types:
        return types, None
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        layers = [i for i, t in enumerate(types) if t == SLIDING]
        raise DFlashError(
            f"draft {where}: layers {layers} are sliding_attention but config.json's sliding_window is {window!r}; "
            "it must be the positive window (in tokens) the draft was trained with"
        )
    return types, window


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference fallback tap rule (dflash-facts section 3).

    One draft layer taps the middle layer; otherwise ids are spread evenly over [1, L - 3].
    Example: 36 target layers, 5 draft layers -> [1, 9, 17, 25, 33].
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class NoDraftSpec(DraftSpec):
    """The draft spec of an artifact without a DFlash draft (`no_draft_spec`): proposals (the MTP head's
    chain, lookups) reach the target graph as ids, over the whole vocabulary."""

    proposes_itself = True


def no_draft_spec(target: TargetSpec, block_size: int) -> DraftSpec:
    """What the target graph serves when the artifact has no DFlash draft (`build --draft none`): its one
    tap is the last layer's output (the post-norm final hidden state, which the MTP head reads), and
    proposals reach it as ids. `block_size` is the rows a step verifies at most by default (the anchor
    and the chain). No draft weights exist."""
    return NoDraftSpec(path=None, arch=target.arch, block_size=block_size, mask_token_id=0,
                       target_layer_ids=(target.arch.num_layers - 1,), taps_declared=True)


def parse_draft_config(cfg: dict[str, Any], target: TargetSpec, where: str, fc_in_features: int | None,
                       architecture: str = "DFlashDraftModel") -> DraftSpec:
    """Validate a draft config dict against its target.

    Args:
        cfg: the draft's config.json content.
        target: the validated target.
        where: how to name the draft in messages.
        fc_in_features: the width of `fc.weight`'s input (None to skip the weight check).
        architecture: the `architectures` entry the calling draft family reads.

    Raises:
        DFlashError: wrong architecture, taps missing/out of range/not matching fc, width or head
            layout mismatch, mask id outside the vocabulary, unsupported layer types or a sliding
            layer without `sliding_window` (see `draft_layer_types`).
    """
    archs = cfg.get("architectures") or []
    if archs and architecture not in archs:
        raise DFlashError(f"draft {where} declares architectures {archs}; expected {architecture}")
    arch = AttentionSpec.from_config(cfg, f"draft {where}")
    layer_types, window = draft_layer_types(cfg, where, arch.num_layers)
    if arch.rope["rope_type"] == "yarn" and arch.rope.get("factor") is None:
        raise DFlashError(f"draft {where}: its YaRN RoPE (rope_scaling / rope_parameters) declares no factor")
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise DFlashError(f"draft {where}: dflash_config must be a JSON object")
    block_size = dcfg.get("block_size", cfg.get("block_size"))
    if block_size is None:
        raise DFlashError(f"draft {where} declares no block_size (top level or dflash_config)")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise DFlashError(f"draft {where}: block_size {block_size!r} must be an integer")
    if block_size < 2:
        raise DFlashError(f"draft {where}: block_size {block_size} must be at least 2")
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise DFlashError(f"draft {where} declares no dflash_config.mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise DFlashError(f"draft {where}: mask_token_id {mask!r} must be an integer token id")
    if not 0 <= mask < target.vocab_size:
        raise DFlashError(
            f"draft {where}: mask_token_id {mask} is outside the target vocabulary [0, {target.vocab_size})"
        )
    taps = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    declared = taps is not None
    if taps is None:
        n_target = int(cfg.get("num_target_layers", target.arch.num_layers))
        taps = build_target_layer_ids(n_target, arch.num_layers)
    if not isinstance(taps, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
        raise DFlashError(f"draft {where}: target_layer_ids {taps!r} must be a list of integer layer ids")
    taps = tuple(taps)
    if not taps:
        raise DFlashError(f"draft {where}: target_layer_ids is empty")
    bad = [t for t in taps if not 0 <= t < target.arch.num_layers]
    if bad:
        raise DFlashError(
            f"draft {where}: tap layers {bad} do not exist in the target ({target.arch.num_layers} layers, ids 0.."
            f"{target.arch.num_layers - 1}); this draft was trained for another target"
        )
    if arch.hidden_size != target.arch.hidden_size:
        raise DFlashError(
            f"draft {where}: hidden_size {arch.hidden_size} != target hidden_size {target.arch.hidden_size}; "
            "this draft belongs to another target"
        )
    if fc_in_features is not None and fc_in_features != len(taps) * target.arch.hidden_size:
        origin = "declared taps" if declared else (
            f"no target_layer_ids declared, so the reference fallback rule gave taps {list(taps)}"
        )
        raise DFlashError(
            f"draft {where}: fc.weight expects {fc_in_features} input features but {len(taps)} taps x hidden "
            f"{target.arch.hidden_size} = {len(taps) * target.arch.hidden_size} ({origin}); the tap list does not match "
            "the weights: declare the draft's dflash_config.target_layer_ids"
        )
    return DraftSpec(
        path=None,
        arch=arch,
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=taps,
        taps_declared=declared,
        layer_types=layer_types,
        sliding_window=window,
        causal_layers=block_causality(cfg, layer_types, where),
    )


def read_draft_checkpoint(draft_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config dict, state dict) of a draft directory of any draft family, weight names stripped of a
    leading "model.".

    Raises:
        DFlashError: only a train-draft resume state, no or a bad config.json, missing or corrupted
            weights, no fc.weight (not a DFlash draft).
    """
    if not (draft_dir / "config.json").exists() and (draft_dir / "train_state" / "state.safetensors").is_file():
        raise DFlashError(f"draft {draft_dir} holds only a train-draft resume state (the training did not finish); "
                          f"continue it with `python -m dflash_export train-draft --resume {draft_dir} --out {draft_dir} ...` "
                          "and the run's other options")
    cfg = read_config(draft_dir)
    state = load_state_dict(draft_dir)
    state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    if "fc.weight" not in state:
        raise DFlashError(f"draft {draft_dir} has no fc.weight; it is not a DFlash draft checkpoint")
    return cfg, state


def load_draft_spec(draft_dir: Path, target: TargetSpec) -> tuple[DraftSpec, dict[str, Any]]:
    """Validate a draft directory and load its weights.

    Returns:
        (spec, state_dict) with weight names stripped of any leading "model." prefix.

    Raises:
        DFlashError: see :func:`parse_draft_config`; also missing or corrupted weights and
            weights whose shapes contradict the config (head layout mismatch).
    """
    draft_dir = Path(draft_dir)
    cfg, state = read_draft_checkpoint(draft_dir)
    if any(k.startswith("candidate_selector.") for k in state):
        raise DFlashError(f"draft {draft_dir} holds DFlash 2 weights (candidate_selector.*) but its config.json declares "
                          f"architectures {cfg.get('architectures')}; set \"architectures\": [\"DFlash2DraftModel\"]")
    spec = parse_draft_config(cfg, target, str(draft_dir), int(state["fc.weight"].shape[1]))
    check_draft_weights(spec, state, str(draft_dir))
    vocab = read_draft_vocab(draft_dir, target.vocab_size)
    return DraftSpec(**{**spec.__dict__, "path": draft_dir, "draft_vocab": vocab}), state


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(draft_dir: Path, vocab_size: int) -> tuple[int, ...] | None:
    """Read a draft's proposal vocabulary, `draft_vocab.json` (`{"token_ids": [...]}`), if it has one.

    A draft trained with a reduced softmax (see `train.loss_vocabulary`) proposes only from those ids;
    the reference implementation ignores the file and uses the full head.

    Returns:
        sorted unique ids, or None when the file is absent.

    Raises:
        DFlashError: a non-file of that name, an unreadable or invalid file, or ids that are not unique
            ints in [0, vocab_size).
    """
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    if not path.exists():
        if not path.is_symlink():
            return None
        raise DFlashError(f"{path} is a link to {os.path.realpath(path)}, which does not exist; fix the link, "
                          "or remove it to use the full vocabulary")  # a dangling link: a mistake, not "absent"
    if not path.is_file():  # a directory or device of that name is a mistake, not "no vocabulary"
        raise DFlashError(f"{path} is not a regular file; remove it to use the full vocabulary")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{path} is not valid JSON ({exc}); delete it to use the full vocabulary") from None
    except OSError as exc:
        raise DFlashError(f"cannot read {path}: {exc.strerror or exc}; fix its permissions or delete it") from None
    except RecursionError:
        raise DFlashError(f"{path} is nested too deeply to be a vocabulary file; delete it to use the full vocabulary") from None
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise DFlashError(f"{path} must hold {{\"token_ids\": [int, ...]}} (non-empty); delete it to use the full vocabulary")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise DFlashError(f"{path}: token ids must be unique and in [0, {vocab_size}) (the target's vocabulary)")
    return tuple(sorted(ids))


def draft_weight_shapes(spec: DraftSpec, n_target_hidden: int) -> dict[str, tuple[int, ...]]:
    """Expected shape of every draft weight (dflash-facts section 1)."""
    a = spec.arch
    d, hd = a.hidden_size, a.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (d, len(spec.target_layer_ids) * n_target_hidden),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(a.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (a.num_heads * hd, d),
                p + "self_attn.k_proj.weight": (a.num_kv_heads * hd, d),
                p + "self_attn.v_proj.weight": (a.num_kv_heads * hd, d),
                p + "self_attn.o_proj.weight": (d, a.num_heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (a.intermediate_size, d),
                p + "mlp.up_proj.weight": (a.intermediate_size, d),
                p + "mlp.down_proj.weight": (d, a.intermediate_size),
            }
        )
        if a.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (a.num_heads * hd,),
                    p + "self_attn.k_proj.bias": (a.num_kv_heads * hd,),
                    p + "self_attn.v_proj.bias": (a.num_kv_heads * hd,),
                    p + "self_attn.o_proj.bias": (d,),
                }
            )
    return shapes


def check_draft_weights(spec: DraftSpec, state: dict[str, Any], where: str,
                        expected: dict[str, tuple[int, ...]] | None = None) -> None:
    """Check that every expected draft weight (`expected`: name -> shape; default v1's,
    `draft_weight_shapes`) exists with the shape the config implies.

    Raises:
        DFlashError: a weight is missing or has another shape (e.g. a head layout mismatch).
    """
    expected = draft_weight_shapes(spec, spec.arch.hidden_size) if expected is None else expected
    missing = [k for k in expected if k not in state]
    if missing:
        raise DFlashError(f"draft {where} lacks weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            heads = (f" (heads {spec.arch.num_heads}, kv heads {spec.arch.num_kv_heads}, head_dim {spec.arch.head_dim})"
                     if "self_attn" in k else "")
            raise DFlashError(
                f"draft {where}: {k} has shape {tuple(state[k].shape)} but the config implies {shape}{heads}; "
                "config and weights disagree"
            )
    bad = [k for k in expected if state[k].is_floating_point() and not bool(state[k].isfinite().all())]
    if bad:  # e.g. a diverged training run: it would export and propose garbage without any error
        raise DFlashError(f"draft {where}: weights {bad[:4]}{' ...' if len(bad) > 4 else ''} hold NaN or infinite "
                          "values; the checkpoint is broken (a diverged training run?): retrain it, e.g. with a lower --lr")
