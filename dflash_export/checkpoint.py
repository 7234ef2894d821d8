"""Reading and validating Hugging Face target and DFlash draft checkpoints.

Only `config.json` and safetensors files are read: no `auto_map` remote code is ever executed and
no pickled weights are ever loaded. Every check raises :class:`runtime.errors.DFlashError` with a
message that names the problem and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import DFlashError

SUPPORTED_TARGETS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ATTENTION_LAYER_TYPES = ("full_attention",)


def read_config(model_dir: Path) -> dict[str, Any]:
    """Read `config.json` of a Hugging Face model directory.

    Raises:
        DFlashError: the directory or its config is missing or is not valid JSON.
    """
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise DFlashError(f"model directory {model_dir} does not exist; pass a local Hugging Face directory")
    if not path.is_file():
        raise DFlashError(f"{model_dir} has no config.json; it is not a Hugging Face model directory")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{path} is not valid JSON ({exc}); re-download the checkpoint") from None
    if not isinstance(cfg, dict):
        raise DFlashError(f"{path} does not hold a JSON object; re-download the checkpoint")
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    """List the safetensors files of a checkpoint (single file or sharded with an index).

    Raises:
        DFlashError: no safetensors weights (pickled `.bin` weights are refused on purpose).
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise DFlashError(f"{index} is malformed ({exc}); re-download the checkpoint") from None
        bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or not s.endswith(".safetensors")]
        if bad:
            raise DFlashError(f"{index} names shards {bad[:3]}, not .safetensors files beside it; re-download the checkpoint")
        files = [model_dir / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DFlashError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise DFlashError(
            f"{model_dir} has only pickled weights (.bin/.pt); dflash_export never unpickles weights. "
            "Convert them to safetensors first (e.g. save_pretrained(..., safe_serialization=True))."
        )
    raise DFlashError(f"{model_dir} has no *.safetensors weights")


def load_state_dict(model_dir: Path) -> dict[str, "Any"]:
    """Load every tensor of a checkpoint's safetensors files as torch tensors (CPU).

    Returns:
        dict name -> torch.Tensor, dtypes as stored.

    Raises:
        DFlashError: a file is truncated or corrupted.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in safetensors_files(model_dir):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DFlashError(
                f"cannot read {f}: {exc}. The file is corrupted or truncated; re-download or re-convert it."
            ) from None
    return state


def share_permissions(path: Path) -> None:
    """Give `path` (a file, or a directory and everything under it) the modes a shared model or
    cache wants, 0755 directories and 0644 files: `mkdtemp` and safetensors' writer leave 0700/0600,
    which locks other users (and containers running as another uid) out of a cache or a draft."""
    path = Path(path)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, 0o755 if p.is_dir() else 0o644)


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file, read in 1 MiB chunks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalise old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) RoPE fields."""
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise DFlashError("rope_parameters / rope_scaling must be JSON objects")
    params = dict(params)
    params.update(scaling)  # as transformers: an explicit rope_scaling overrides the defaults
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params.get("rope_type") == "default" and "factor" in scaling:
        params["rope_type"] = "linear"  # legacy `{"factor": f}` without a type means linear scaling
    if isinstance(params["rope_theta"], bool) or not isinstance(params["rope_theta"], (int, float)):
        raise DFlashError(f"rope_theta {params['rope_theta']!r} is not a number")
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise DFlashError(
            f"RoPE type {params['rope_type']!r} is not supported yet (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return params


def _check_layer_types(cfg: dict[str, Any], what: str) -> None:
    types = cfg.get("layer_types")
    if types:
        bad = sorted({t for t in types if t not in _ATTENTION_LAYER_TYPES})
        if bad:
            raise DFlashError(
                f"{what} uses layer types {bad}; only full_attention is supported by this exporter yet "
                "(sliding-window drafts/targets need a windowed mask, not implemented)"
            )
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise DFlashError(f"{what} enables sliding-window attention, which this exporter does not support yet")


@dataclass(frozen=True)
class AttentionSpec:
    """Sizes of one transformer stack (target or draft).

    Attributes:
        hidden_size: model width d.
        intermediate_size: SwiGLU inner width.
        num_layers: decoder layers.
        num_heads / num_kv_heads / head_dim: GQA layout; head_dim comes from the config when present.
        rms_norm_eps: RMSNorm epsilon.
        rope: normalised RoPE parameters (`rope_type`, `rope_theta`, scaling fields).
        attention_bias / mlp_bias: whether q/k/v/o (resp. MLP) projections have biases.
        raw: the full config dict (used to rebuild a transformers config for RoPE init).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    attention_bias: bool
    mlp_bias: bool
    raw: dict[str, Any] = field(repr=False, hash=False, compare=False)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], what: str) -> "AttentionSpec":
        """Build from a config dict; raises DFlashError when a required field is missing."""
        try:
            heads = int(cfg["num_attention_heads"])
            spec = cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=_rope_parameters(cfg),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                raw=cfg,
            )
        except KeyError as exc:
            raise DFlashError(f"{what} config.json lacks the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise DFlashError(f"{what} config.json has a field of the wrong type ({exc})") from None
        if min(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) < 1:
            raise DFlashError(f"{what} config.json has a non-positive size field")
        if spec.num_heads % spec.num_kv_heads:
            raise DFlashError(
                f"{what}: num_attention_heads {spec.num_heads} is not a multiple of num_key_value_heads {spec.num_kv_heads}"
            )
        return spec


@dataclass(frozen=True)
class TargetSpec:
    """A validated target checkpoint.

    Attributes:
        path: local directory.
        family: "qwen3" (q_norm/k_norm) or "llama".
        arch: sizes and RoPE.
        vocab_size: rows of embed_tokens / lm_head.
        tie_word_embeddings: lm_head shares embed_tokens.
        eos_token_ids: stop ids declared by config.json and generation_config.json.
    """

    path: Path
    family: str
    arch: AttentionSpec
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]


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
    """

    path: Path | None
    arch: AttentionSpec
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    taps_declared: bool
    draft_vocab: tuple[int, ...] | None = None


def load_target_spec(model_dir: Path) -> TargetSpec:
    """Validate a target directory (Qwen3ForCausalLM or LlamaForCausalLM).

    Raises:
        DFlashError: unsupported architecture, sliding-window layers, missing fields or weights.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" in archs:  # its model_type is the target family's, so it would pass below
        raise DFlashError(f"{model_dir} is a DFlash draft, not a target; pass the target model as --target "
                          "(and the draft as --draft where the command takes one)")
    family = next((SUPPORTED_TARGETS[a] for a in archs if a in SUPPORTED_TARGETS), None)
    if family is None:
        family = {"qwen3": "qwen3", "llama": "llama"}.get(cfg.get("model_type", ""))
    if family is None:
        from .hybrid_spec import hybrid_kind, parse_hybrid_config, refuse_until_exportable

        kind = hybrid_kind(cfg)  # refuses mixture-of-experts variants by name
        if kind is not None:
            refuse_until_exportable(parse_hybrid_config(cfg, kind, f"target {model_dir}"), f"target {model_dir}")
    if family is None:
        raise DFlashError(
            f"target {model_dir} has architectures {archs or cfg.get('model_type')}; supported: "
            f"{', '.join(SUPPORTED_TARGETS)}"
        )
    if cfg.get("quantization_config"):
        qcfg = cfg["quantization_config"]
        method = qcfg.get("quant_method", "unknown") if isinstance(qcfg, dict) else "unknown"
        raise DFlashError(f"target {model_dir} is already quantized (quantization_config: {method}); dflash_export "
                          "reads full-precision weights: pass the unquantized checkpoint (build --quant int4 "
                          "quantizes it here)")
    _check_layer_types(cfg, f"target {model_dir}")
    arch = AttentionSpec.from_config(cfg, f"target {model_dir}")
    safetensors_files(model_dir)
    eos: list[int] = []
    for source in (cfg, _read_optional_json(model_dir / "generation_config.json")):
        value = source.get("eos_token_id") if isinstance(source, dict) else None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in eos:
                eos.append(v)
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise DFlashError(f"target {model_dir} config.json has vocab_size {vocab!r}; expected a positive integer")
    return TargetSpec(
        path=model_dir,
        family=family,
        arch=arch,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=tuple(eos),
    )


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference fallback tap rule (dflash-facts section 3).

    One draft layer taps the middle layer; otherwise ids are spread evenly over [1, L - 3].
    Example: 36 target layers, 5 draft layers -> [1, 9, 17, 25, 33].
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def parse_draft_config(cfg: dict[str, Any], target: TargetSpec, where: str, fc_in_features: int | None) -> DraftSpec:
    """Validate a draft config dict against its target.

    Args:
        cfg: the draft's config.json content.
        target: the validated target.
        where: how to name the draft in messages.
        fc_in_features: the width of `fc.weight`'s input (None to skip the weight check).

    Raises:
        DFlashError: wrong architecture, taps missing/out of range/not matching fc, width or head
            layout mismatch, mask id outside the vocabulary, unsupported layer types.
    """
    archs = cfg.get("architectures") or []
    if archs and "DFlashDraftModel" not in archs:
        raise DFlashError(f"draft {where} declares architectures {archs}; expected DFlashDraftModel")
    _check_layer_types(cfg, f"draft {where}")
    arch = AttentionSpec.from_config(cfg, f"draft {where}")
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
    )


def load_draft_spec(draft_dir: Path, target: TargetSpec) -> tuple[DraftSpec, dict[str, Any]]:
    """Validate a draft directory and load its weights.

    Returns:
        (spec, state_dict) with weight names stripped of any leading "model." prefix.

    Raises:
        DFlashError: see :func:`parse_draft_config`; also missing or corrupted weights and
            weights whose shapes contradict the config (head layout mismatch).
    """
    draft_dir = Path(draft_dir)
    if not (draft_dir / "config.json").exists() and (draft_dir / "train_state" / "state.safetensors").is_file():
        raise DFlashError(f"draft {draft_dir} holds only a train-draft resume state (the training did not finish); "
                          f"continue it with `python -m dflash_export train-draft --resume {draft_dir} --out {draft_dir} ...` "
                          "and the run's other options")
    cfg = read_config(draft_dir)
    state = load_state_dict(draft_dir)
    state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    if "fc.weight" not in state:
        raise DFlashError(f"draft {draft_dir} has no fc.weight; it is not a DFlash draft checkpoint")
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


def check_draft_weights(spec: DraftSpec, state: dict[str, Any], where: str) -> None:
    """Check that every expected draft weight exists with the shape the config implies.

    Raises:
        DFlashError: a weight is missing or has another shape (e.g. a head layout mismatch).
    """
    expected = draft_weight_shapes(spec, spec.arch.hidden_size)
    missing = [k for k in expected if k not in state]
    if missing:
        raise DFlashError(f"draft {where} lacks weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise DFlashError(
                f"draft {where}: {k} has shape {tuple(state[k].shape)} but the config implies {shape} "
                f"(heads {spec.arch.num_heads}, kv heads {spec.arch.num_kv_heads}, head_dim {spec.arch.head_dim}); "
                "config and weights disagree"
            )
    bad = [k for k in expected if state[k].is_floating_point() and not bool(state[k].isfinite().all())]
    if bad:  # e.g. a diverged training run: it would export and propose garbage without any error
        raise DFlashError(f"draft {where}: weights {bad[:4]}{' ...' if len(bad) > 4 else ''} hold NaN or infinite "
                          "values; the checkpoint is broken (a diverged training run?): retrain it, e.g. with a lower --lr")


def hf_cache_dirs() -> list[Path]:
    """Hugging Face hub cache roots to search, honouring HF_HUB_CACHE / HF_HOME."""
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    roots.append(home / "hub")
    return roots


def resolve_hub_snapshot(repo_id: str) -> Path | None:
    """Find the newest local snapshot of a hub repository without any network access."""
    folder = "models--" + repo_id.replace("/", "--")
    for root in hf_cache_dirs():
        snaps = root / folder / "snapshots"
        if snaps.is_dir():
            ref = root / folder / "refs" / "main"
            if ref.is_file() and (snaps / ref.read_text().strip()).is_dir():
                return snaps / ref.read_text().strip()
            cands = sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            if cands:
                return cands[0]
    return None
