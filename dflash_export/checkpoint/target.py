"""Reading and validating Hugging Face target checkpoints, and the file helpers every checkpoint
reader shares. `load_target_spec` asks each target family to read the config (the family's
`read_target` hook, `families/registry.py`: Qwen3 / Llama in `families/dense.py`, Qwen3.5 hybrids in
`families/qwen3_5.py` over `checkpoint/hybrid.py`); drafts are read by `checkpoint/draft.py`.

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

# the dense architectures `families.dense.read_target` takes by name (the refusal of an unknown target lists them)
SUPPORTED_TARGETS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ATTENTION_LAYER_TYPES = ("full_attention",)
DRAFT_LAYER_TYPES = ("full_attention", "sliding_attention")  # a DFlash draft's layers


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


def check_layer_types(cfg: dict[str, Any], what: str, draft: bool = False) -> None:
    """Refuse layer types this exporter cannot build.

    Targets (Qwen3 / Llama) take full_attention layers only (a windowed target mask is not
    implemented). DFlash drafts (`draft=True`) also take sliding_attention layers; their window is
    read and checked by `checkpoint.draft.draft_layer_types`.

    Raises:
        DFlashError: `layer_types` is not a list of names, or names a type the stack cannot take.
    """
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise DFlashError(f"{what}: layer_types {types!r} must be a list of layer type names")
    allowed = DRAFT_LAYER_TYPES if draft else _ATTENTION_LAYER_TYPES
    if types:
        bad = sorted({t for t in types if t not in allowed})
        if bad and draft:
            raise DFlashError(
                f"{what} uses layer types {bad}; a DFlash draft's layers must be one of {list(DRAFT_LAYER_TYPES)}"
            )
        if bad:
            raise DFlashError(
                f"{what} uses layer types {bad}; only full_attention is supported by this exporter yet "
                "(sliding-window targets need a windowed mask, not implemented)"
            )
    if not draft and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
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
        family: "qwen3" (q_norm/k_norm), "llama" or "qwen3_5" (the Gated DeltaNet hybrid: see `hybrid`).
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
    hybrid: Any = None  # checkpoint.hybrid.HybridSpec of a Qwen3.5/3.6 target (arch: its attention layers' sizes)


def refuse_quantized(cfg: dict[str, Any], model_dir: Path) -> None:
    """Refuse a target that is already quantized (its config has a `quantization_config`).

    Raises:
        DFlashError: naming the quantization method and the fix.
    """
    if cfg.get("quantization_config"):
        qcfg = cfg["quantization_config"]
        method = qcfg.get("quant_method", "unknown") if isinstance(qcfg, dict) else "unknown"
        raise DFlashError(f"target {model_dir} is already quantized (quantization_config: {method}); dflash_export "
                          "reads full-precision weights: pass the unquantized checkpoint (build --quant int4 "
                          "quantizes it here)")


def read_eos_token_ids(model_dir: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Stop ids declared by config.json and generation_config.json, in that order."""
    eos: list[int] = []
    for source in (cfg, _read_optional_json(model_dir / "generation_config.json")):
        value = source.get("eos_token_id") if isinstance(source, dict) else None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in eos:
                eos.append(v)
    return tuple(eos)


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}


def head_name(tspec: TargetSpec) -> str:
    """The checkpoint name of the LM head matrix (the embedding table's when tied)."""
    return "model.embed_tokens.weight" if tspec.tie_word_embeddings else "lm_head.weight"
