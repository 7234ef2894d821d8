"""`build`: validate a target/draft pair, export both graphs and write a self-contained artifact.

The artifact directory is assembled in a temporary sibling directory and renamed into place only
when every stage succeeded, so it appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflash_export import __version__
from dflash_export.checkpoint.draft import DraftSpec, no_draft_spec
from dflash_export.checkpoint.outputs import check_output_dir, staged_directory
from dflash_export.checkpoint.sources import SourceHashes, resolve_draft, resolve_target
from dflash_export.checkpoint.target import TargetSpec, head_name, safetensors_files
from dflash_export.checkpoint.weights import WeightSource
from dflash_export.drafts.registry import (
    DEFAULT_DRAFT_FAMILY,
    draft_family,
    family_of,
    load_draft,
)
from dflash_export.export.checks import check_graph
from dflash_export.families.registry import load_target_spec, target_family
from dflash_export.nn.layers import rope_inv_freq
from dflash_export.quant.int4 import (
    DEFAULT_BLOCKS,
    BlockMismatch,
    QuantConfig,
    quantization_record,
)
from runtime.errors import DFlashError
from runtime.manifest import MANIFEST_FORMAT, MANIFEST_VERSION
from runtime.options import MTP_DEFAULT_LENGTH


@dataclass
class Stage:
    """Prints numbered build stages with their durations (to stderr)."""

    total: int
    quiet: bool = False
    n: int = 0

    def __call__(self, title: str):
        """Context manager timing the next stage."""
        self.n += 1
        return _StageTimer(f"[{self.n}/{self.total}] {title}", self.quiet)

    def report(self, text: str) -> None:
        """Count a stage that already finished and print one line for it."""
        self.n += 1
        if not self.quiet:
            print(f"[{self.n}/{self.total}] {text}", file=sys.stderr, flush=True)


class _StageTimer:
    def __init__(self, title: str, quiet: bool):
        self.title, self.quiet = title, quiet

    def __enter__(self):
        self.t0 = time.perf_counter()
        if not self.quiet:
            print(f"{self.title} ...", file=sys.stderr, flush=True)
        return self

    def __exit__(self, exc_type, *_):
        if not self.quiet and exc_type is None:
            print(f"{self.title}: done in {time.perf_counter() - self.t0:.1f}s", file=sys.stderr, flush=True)


def prepare_pair(target: str | None, draft: str | None,
                 mtp: bool = True) -> tuple[TargetSpec, DraftSpec, WeightSource, dict | None, str | None]:
    """Resolve and validate the target and draft before anything is exported.

    The target's weights are not loaded: its :class:`WeightSource` knows every tensor's name, shape
    and dtype (from the safetensors headers) and reads a tensor when asked. The draft (small, and
    checked for non-finite values) is loaded. `draft` "none", or None for a target without a known
    draft whose checkpoint has an MTP head (`mtp`: the head is exported), means no DFlash draft: the
    draft spec is then `no_draft_spec`'s and the state dict None.

    Returns:
        (target spec, draft spec, target weight source, draft state dict or None, known target name).

    Raises:
        DFlashError: any validation failure (see checkpoint/target.py).
    """
    target_dir, name = resolve_target(target)
    tspec = load_target_spec(target_dir)
    tsource = WeightSource(f"target {tspec.path}", files=safetensors_files(tspec.path))
    draft_dir = None if draft == "none" else resolve_draft(draft, name)
    if draft == "none" or (draft is None and draft_dir is None and mtp and _has_mtp_tensors(tspec, tsource)):
        dspec, dstate = no_draft_spec(tspec, MTP_DEFAULT_LENGTH + 1), None
    else:
        _, dspec, dstate = load_draft(draft_dir, tspec)

    for arch, family, what in ((tspec.arch, tspec.family, "target"), (dspec.arch, "qwen3", "draft")):
        try:
            rope_inv_freq(arch, family)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DFlashError(f"{what}: RoPE parameters {arch.rope} are incomplete or invalid ({exc!r})") from None
    target_family(tspec.family).check_weights(tspec, dspec.target_layer_ids, tsource)
    return tspec, dspec, tsource, dstate, name


def _has_mtp_tensors(tspec: TargetSpec, tsource: WeightSource) -> bool:
    """Whether the target checkpoint stores a multi-token-prediction head (`mtp.*`, Qwen3.5 / Qwen3.6)."""
    return hasattr(target_family(tspec.family), "mtp_source") and any(n.startswith("mtp.") for n in tsource.names())


@dataclass(frozen=True)
class BuildOptions:
    """What `build` exports and how (the flags of `python -m dflash_export build`).

    Attributes:
        target: target directory or known name; None for the embedded SmolLM2-135M-Instruct.
        draft: draft directory or hub id; None for the target's released/shipped draft, or where there
            is none an untrained deterministic draft (reported in the manifest), or no draft when the
            checkpoint has an MTP head (exported); "none": no DFlash draft (the MTP head drafts, or the
            artifact decodes plain).
        out: artifact directory (replaced atomically).
        max_seq_len: KV buffer capacity in tokens (prompt + new tokens), >= 2.
        dtype: "fp32" or "fp16" graph precision (norms, fc and softmax stay fp32).
        draft_vocab: "auto" proposes from the draft's `draft_vocab.json` when it has one (fewer LM-head
            rows per proposal, same output); "full" always uses the whole vocabulary.
        quant: "int4" stores the target's decoder linear layers INT4 weight-only (the DequantizeLinear
            form TensorRT and onnxruntime both load, docs/quantization.md); "none" keeps `dtype` weights.
        quant_block: INT4 values per scale along K (a power of two >= 16 dividing each layer's K);
            None: 32, or 16 where 32 does not divide every quantized layer's K.
        quant_method: "rtn" (round to nearest, the default) or "awq" (activation-aware scales
            calibrated on models/prompts text, folded in before rounding).
        quant_lm_head: with int4, the LM head too (the embedding lookups keep their table).
        proposal_head: "full" keeps the proposal vocabulary's head rows in the graph dtype; "int4"
            stores them INT4 (they only rank proposals, which the full head verifies: output unchanged).
        mtp: export the target's multi-token-prediction head as `mtp.onnx` where the checkpoint has one
            (`mtp.*`, Qwen3.5 / Qwen3.6: `nn.mtp`); False leaves it out.
        batched: also export the batched target (`target_batched.onnx`, reading target.onnx's weights
            file), which `runtime.batching` serves several sequences at once with (dense targets).
        quiet: print no progress.
        overwrite: replace an existing artifact at `out`.
    """

    target: str | None = None
    draft: str | None = None
    out: Path | str = "artifacts/default"
    max_seq_len: int = 2048
    dtype: str = "fp32"
    draft_vocab: str = "auto"
    quant: str = "none"
    quant_block: int | None = None
    quant_method: str | None = None
    quant_lm_head: bool = False
    proposal_head: str = "full"
    batched: bool = False
    mtp: bool = True
    quiet: bool = False
    overwrite: bool = True

    def quant_config(self, block: int | None = None) -> QuantConfig | None:
        """The INT4 configuration (None without --quant int4), at `block` where quant_block is unset.

        Raises:
            DFlashError: an option out of range, or an INT4 option without --quant int4.
        """
        for flag, value, allowed in (("--dtype", self.dtype, ("fp32", "fp16")),
                                     ("--draft-vocab", self.draft_vocab, ("auto", "full")),
                                     ("--quant", self.quant, ("none", "int4")),
                                     ("--proposal-head", self.proposal_head, ("int4", "full"))):
            if value not in allowed:
                raise DFlashError(f"{flag} must be {' or '.join(allowed)} (got {value!r})")
        if self.max_seq_len < 2:
            raise DFlashError(f"--max-seq-len must be at least 2 (got {self.max_seq_len})")
        given = [flag for flag, value in (("--quant-block", self.quant_block), ("--quant-method", self.quant_method),
                                          ("--quant-lm-head", self.quant_lm_head or None)) if value is not None]
        if given and self.quant != "int4":
            raise DFlashError(f"{', '.join(given)} needs --quant int4")
        if self.quant != "int4":
            return None
        qconfig = QuantConfig(method=self.quant_method or "rtn", block=self.quant_block or block or DEFAULT_BLOCKS[0],
                              lm_head=self.quant_lm_head)
        qconfig.validate()
        return qconfig


def _checked_quant_config(options: BuildOptions, family, tspec: TargetSpec, dspec: DraftSpec,
                          tsource: WeightSource) -> QuantConfig | None:
    """The INT4 configuration the family accepts: the given block, or without --quant-block the first
    of DEFAULT_BLOCKS that divides every quantized layer's K (said on stderr unless quiet).

    Raises:
        DFlashError: an option the family refuses (the last default block's mismatch where none fits)."""
    for block in DEFAULT_BLOCKS if options.quant_block is None else (options.quant_block,):
        qconfig = options.quant_config(block)
        try:
            family.check_options(tspec, dspec.target_layer_ids, tsource, qconfig, options.proposal_head)
        except BlockMismatch:
            if options.quant_block is not None or block == DEFAULT_BLOCKS[-1]:
                raise
            continue
        if qconfig is not None and options.quant_block is None and not options.quiet:
            why = "the default" if block == DEFAULT_BLOCKS[0] else f"{DEFAULT_BLOCKS[0]} does not divide every quantized layer's K"
            print(f"INT4 block {block} ({why}; --quant-block overrides)", file=sys.stderr)
        return qconfig
    raise AssertionError("unreachable")


def build(options: BuildOptions) -> dict:
    """Export a target/draft pair into the artifact directory `options.out` (see :class:`BuildOptions`).

    Returns:
        the manifest dict.

    Raises:
        DFlashError: bad input; nothing is written in that case.
    """
    import torch

    o = options
    o.quant_config()  # option errors first, before any checkpoint is read
    out = Path(o.out).resolve()
    check_output_dir(out, o.overwrite)
    t_start = time.perf_counter()
    # Validation prints nothing, so bad input gives exactly one error line.
    tspec, dspec, tsource, dstate, name = prepare_pair(o.target, o.draft, o.mtp)
    family = target_family(tspec.family)
    draft_kind = family_of(dspec.path) if dspec.path is not None else draft_family(DEFAULT_DRAFT_FAMILY)
    # the target's MTP head (checked now: a malformed one fails before any output exists)
    heads = family.mtp_source(tspec, tsource) if o.mtp and hasattr(family, "mtp_source") else None
    if dstate is None and o.draft is None and not o.quiet:
        print("no released DFlash draft is known for this target and its checkpoint has an MTP head: building "
              "without a draft (the MTP head drafts; --draft DIR adds one)", file=sys.stderr)
    qconfig = _checked_quant_config(o, family, tspec, dspec, tsource)
    if o.batched and not getattr(family, "BATCHES", False):
        raise DFlashError(f"--batched needs a Qwen3, Llama or Qwen3.5 target; {tspec.family} targets have no batched "
                          "graph: serve them one request at a time (drop --batched)")
    if o.batched and dstate is None:
        raise DFlashError("--batched needs a DFlash draft (the batched graphs serve the draft's features); build "
                          "without --draft none, or without --batched to serve one request at a time")
    dtype, quiet, proposal_head, max_seq_len = o.dtype, o.quiet, o.proposal_head, o.max_seq_len
    if o.draft_vocab == "full":
        dspec = replace(dspec, draft_vocab=None)
    if heads is not None and dstate is not None and dspec.draft_vocab is None:
        # both drafters' proposals reach the target as ids: the DFlash draft ends in the proposal head
        # (over the whole vocabulary where it names none), and the target takes ids
        dspec = replace(dspec, draft_vocab=tuple(range(tspec.vocab_size)))
    # the manifest's source hashes read every shard once more: done on a thread while the draft and
    # the target template trace (CPU-bound, the disk idle), not after the weights are written
    hashes = SourceHashes(tspec, dspec)
    stage = Stage(total=5 + (heads is not None) - (dstate is None), quiet=quiet)
    stage.report(f"validated target{' and draft' if dstate is not None else ''} in {time.perf_counter() - t_start:.1f}s")
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    with staged_directory(out, "an artifact") as tmp:
        drafted = None
        if dstate is not None:  # the draft first: its weights (held in memory) are freed before the target streams
            with stage(f"exporting draft.onnx{' and draft_batched.onnx' if o.batched else ''}"):
                batched_draft = {"batched_path": tmp / "draft_batched.onnx"} if o.batched and getattr(draft_kind, "BATCHES", False) else {}
                drafted = draft_kind.export_for_build(tspec, dspec, dstate, tsource, tmp / "draft.onnx", torch_dtype,
                                                      qconfig, proposal_head,
                                                      family.DRAFT_PROPOSES or o.batched or heads is not None,
                                                      quiet, **batched_draft)
                del dstate
        head_config, dquant = (drafted.head_config, drafted.quant_plan) if drafted is not None else (None, None)
        with stage(f"exporting target.onnx{' and target_batched.onnx' if o.batched else ''} ({family.EXPORT_TITLE})"):
            extra = {"batched_path": tmp / "target_batched.onnx"} if o.batched else {}
            if heads is not None and drafted is not None:
                extra["final_hidden"] = True  # the rows the MTP head reads (without a draft: the one tap)
            exported = family.export_for_build(tspec, dspec, tsource, tmp / "target.onnx", torch_dtype, qconfig,
                                               proposal_head, quiet, **extra)
        shared = None
        if heads is not None:
            with stage("exporting mtp.onnx (the target's multi-token-prediction head)"):
                shared = family.export_mtp_for_build(tspec, heads, tmp / "mtp.onnx", torch_dtype, tmp / "target.onnx")
                del heads
        with stage("checking graphs (TensorRT 10 operators, duplicate weights)"):
            graphs = ("target",) + (("draft",) if drafted is not None else ()) + (("target_batched",) if o.batched else ())
            graphs += ("mtp",) if shared is not None else ()
            graphs += ("draft_batched",) if drafted is not None and drafted.batched else ()
            checks = {g: check_graph(tmp / f"{g}.onnx") for g in graphs}
        with stage("writing tokenizer and manifest"):
            if drafted is not None:  # (the draft's block rows; nothing reads it without a draft)
                np.save(tmp / "mask_embedding.npy", exported.mask_row.astype(np.float32), allow_pickle=False)
            tok_info = _save_tokenizer(tspec.path, tmp / "tokenizer")
            manifest = _manifest(tspec, dspec, drafted is not None, name, max_seq_len, dtype, checks, tok_info, tmp,
                                 hashes.result())
            if qconfig is not None:
                manifest["quantization"] = {**quantization_record(qconfig, exported.quantized, dtype, head_name(tspec)),
                                            **exported.quant_extra, **({"draft": dquant} if dquant else {})}
            head = exported.proposal_head or (head_config if proposal_head == "int4" else None)
            if head is not None:
                manifest["proposal_head"] = {"format": "int4", "method": head.method, "block": head.block}
            if shared is not None:
                manifest["mtp"] = {"graph": "mtp.onnx", "num_layers": 1, "hidden_size": tspec.hybrid.hidden_size,
                                   "num_kv_heads": tspec.hybrid.num_kv_heads, "head_dim": tspec.hybrid.head_dim,
                                   "weights_shared_with_target": shared}
            manifest["export_seconds"] = round(time.perf_counter() - t_start, 1)
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def _save_tokenizer(target_dir: Path, dest: Path) -> dict:
    """Copy the target's tokenizer files and return chat template / special tokens / stop ids.

    A target without tokenizer files gives an artifact that takes token ids only.
    """
    if not any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return {"chat_template": None, "special_tokens": {}, "eos": []}
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    except Exception as exc:  # transformers raises many types here
        raise DFlashError(f"cannot load the tokenizer of {target_dir}: {exc}") from None
    tok.save_pretrained(str(dest))
    if not (dest / "tokenizer.json").is_file():
        raise DFlashError(f"the tokenizer of {target_dir} has no fast (tokenizer.json) form; the runtime needs one")
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, key, None)
        if isinstance(value, str):
            special[key] = value
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    eos = [tok.eos_token_id] if isinstance(tok.eos_token_id, int) else []
    return {"chat_template": template, "special_tokens": special, "eos": eos}


def _io_spec(path: Path) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            out.append({"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims})
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


def _tool_versions() -> dict:
    import onnx
    import torch
    import transformers

    versions = {
        "dflash_export": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
    }
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return versions


def _shared_weights(tmp: Path, graph: str) -> str:
    """Where a batched graph's weights live: its one-sequence graph's data file, or inline (a small model)."""
    return f"{graph}.onnx's data file" if (tmp / f"{graph}.onnx.data").exists() else "inline, a copy of the one-sequence graph's"


def _no_draft_section(dspec: DraftSpec) -> dict:
    """The manifest's draft section of an artifact without a DFlash draft (`--draft none`): no graph; the
    target graph's taps (its final hidden state) and the rows a step verifies by default."""
    return {"graph": None, "block_size": dspec.block_size, "target_layer_ids": list(dspec.target_layer_ids),
            "trained": False, "draft_vocab_size": None}


def _manifest(tspec: TargetSpec, dspec: DraftSpec, has_draft: bool, name, max_seq_len, dtype, checks, tok_info,
              tmp: Path, hashes: dict[str, dict[str, str]]) -> dict:
    a, da = tspec.arch, dspec.arch
    stop = list(dict.fromkeys([*tspec.eos_token_ids, *tok_info["eos"]]))
    trained = dspec.path is not None
    sources = {"target": {"path": str(tspec.path), "name": name, "files": hashes["target"]},
               "draft": {"path": str(dspec.path) if dspec.path else None, "files": hashes["draft"]}}
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "family": tspec.family,
        "dtype": dtype,
        "max_seq_len": max_seq_len,
        "target": {
            "graph": "target.onnx",
            "num_layers": a.num_layers,
            "hidden_size": a.hidden_size,
            "num_heads": a.num_heads,
            "num_kv_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": tspec.vocab_size,
            "tie_word_embeddings": tspec.tie_word_embeddings,
            "rope": a.rope,
            **target_family(tspec.family).manifest_fields(tspec),  # a hybrid's layer types and state sizes
        },
        "draft": {
            "graph": "draft.onnx",
            "num_layers": da.num_layers,
            "num_heads": da.num_heads,
            "num_kv_heads": da.num_kv_heads,
            "head_dim": da.head_dim,
            "block_size": dspec.block_size,
            "mask_token_id": dspec.mask_token_id,
            "target_layer_ids": list(dspec.target_layer_ids),
            "taps_declared": dspec.taps_declared,
            "trained": trained,
            # proposals come from this many ids (draft_vocab.json); None: the full vocabulary
            "draft_vocab_size": None if dspec.draft_vocab is None else len(dspec.draft_vocab),
            "rope": da.rope,
            **dspec.manifest_fields(),  # layer_types + sliding_window, only for drafts with sliding layers
        } if has_draft else _no_draft_section(dspec),
        "mask_embedding": "mask_embedding.npy" if has_draft else None,
        "stop_token_ids": stop,
        "chat_template": tok_info["chat_template"],
        "special_tokens": tok_info["special_tokens"],
        "io": {g: _io_spec(tmp / f"{g}.onnx") for g in checks},
        "graph_checks": checks,
        **({"target_batched": {"graph": "target_batched.onnx", "num_layers": a.num_layers, "num_kv_heads": a.num_kv_heads,
                               "head_dim": a.head_dim, "hidden_size": a.hidden_size, "vocab_size": tspec.vocab_size,
                               "weights": _shared_weights(tmp, "target"), "draft_features": True,
                               "greedy": "topk"}}
           if "target_batched" in checks else {}),
        **({"draft_batched": {"graph": "draft_batched.onnx", "weights": _shared_weights(tmp, "draft")}}
           if "draft_batched" in checks else {}),
        "sources": sources,
        "tools": _tool_versions(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
    }
