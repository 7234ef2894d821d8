"""`build`: validate a target/draft pair, export both graphs and write a self-contained artifact.

The artifact directory is assembled in a temporary sibling directory and renamed into place only
when every stage succeeded, so it appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime.errors import DFlashError
from runtime.manifest import MANIFEST_FORMAT, MANIFEST_VERSION

from dflash_export import __version__
from dflash_export.checkpoint.target import TargetSpec, safetensors_files
from dflash_export.families.registry import load_target_spec
from dflash_export.checkpoint.draft import DraftSpec, load_draft_spec, parse_draft_config
from dflash_export.checkpoint.sources import SourceHashes, random_draft_config, resolve_draft, resolve_target
from dflash_export.families.dense import head_name, streaming_rewrite
from dflash_export.families.registry import draft_proposes, target_family
from dflash_export.quant.int4 import QuantConfig, draft_quant_plan, quantization_record
from dflash_export.checkpoint.weights import WeightSource, bind_weights, empty_module
from dflash_export.checkpoint.weights import placeholder
from dflash_export.export.checks import check_graph
from dflash_export.export.graphs import export_draft
from dflash_export.families.dense import proposal_head_config
from dflash_export.nn.draft import DFlashDraft, ProposingDraft
from dflash_export.nn.layers import cast_for_export, rope_inv_freq


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


def check_output_dir(out: Path, overwrite: bool = True, markers: tuple[str, ...] = ("manifest.json",),
                     kind: str = "dflash_export artifact", allowed: tuple[str, ...] | None = None) -> None:
    """Refuse an output location the atomic rename cannot serve, before any work is done. A directory
    that exists may only be replaced if it holds one of `markers` (an earlier output of the same
    command, `kind`) and, when `allowed` is given, no entry outside it, or nothing: never a user's
    other files.

    Raises:
        DFlashError: `out` is a file, a mount point, an existing directory without `overwrite`, a
            non-empty directory without any of `markers` or with entries outside `allowed`, or its
            parent is not writable.
    """
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out} is a file; choose a directory path")
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} exists; remove it or pass --overwrite")
    if out.is_dir() and os.path.ismount(out):
        raise DFlashError(f"--out {out} is a mount point, which cannot be replaced atomically; use a subdirectory of it")
    if out.is_dir() and any(out.iterdir()):
        others = sorted(p.name for p in out.iterdir() if allowed is not None and p.name not in allowed)
        if others or not any((out / m).exists() for m in markers):
            raise DFlashError(f"{out} exists and is not a {kind}{f' (it holds {others[:3]})' if others else ''}; "
                              "choose another --out")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DFlashError(f"cannot write to {parent}; choose a writable --out")


def random_draft_state(spec: DraftSpec, seed: int = 0) -> dict:
    """Deterministic random-init weights for an untrained draft (normal(0, 0.02), unit norms)."""
    import torch


    gen = torch.Generator().manual_seed(seed)
    module = empty_module(lambda: DFlashDraft(spec))  # names and shapes only, in state-dict order
    state = {}
    for k, v in module.state_dict().items():
        state[k] = torch.ones(v.shape) if k.endswith("norm.weight") else torch.randn(v.shape, generator=gen) * 0.02
    return state


def prepare_pair(target: str | None, draft: str | None) -> tuple[TargetSpec, DraftSpec, WeightSource, dict, str | None]:
    """Resolve and validate the target and draft before anything is exported.

    The target's weights are not loaded: its :class:`WeightSource` knows every tensor's name, shape
    and dtype (from the safetensors headers) and reads a tensor when asked. The draft (small, and
    checked for non-finite values) is loaded.

    Returns:
        (target spec, draft spec, target weight source, draft state dict, known target name).

    Raises:
        DFlashError: any validation failure (see checkpoint.py).
    """
    target_dir, name = resolve_target(target)
    tspec = load_target_spec(target_dir)
    draft_dir = resolve_draft(draft, name)
    if draft_dir is None:
        cfg = random_draft_config(tspec)
        dspec = parse_draft_config(cfg, tspec, "(untrained)", None)
        dstate = random_draft_state(dspec)
    else:
        dspec, dstate = load_draft_spec(draft_dir, tspec)

    for arch, family, what in ((tspec.arch, tspec.family, "target"), (dspec.arch, "qwen3", "draft")):
        try:
            rope_inv_freq(arch, family)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DFlashError(f"{what}: RoPE parameters {arch.rope} are incomplete or invalid ({exc!r})") from None
    tsource = WeightSource(f"target {tspec.path}", files=safetensors_files(tspec.path))
    target_family(tspec.family).check_weights(tspec, dspec.target_layer_ids, tsource)
    return tspec, dspec, tsource, dstate, name


def draft_export_module(dspec: DraftSpec, source: WeightSource, dtype) -> tuple:
    """The draft's export module in `dtype` (fc and norms fp32) with streamed weights.

    Returns:
        (DFlashDraft, {initializer name: reader}) for `export.export_draft`.
    """

    module = empty_module(lambda: DFlashDraft(dspec, dtype)).eval()
    cast_for_export(module, dtype)
    return module, bind_weights(module, source, source.where)


def _attach_proposal_head(dmod, dreaders: dict, tspec: TargetSpec, dspec: DraftSpec, tsource: WeightSource, dtype,
                          qconfig, proposal_head: str) -> tuple:
    """The draft export module ending in the proposal head (`draft_model.ProposingDraft`): the target's
    LM head rows of the draft's proposal vocabulary, streamed into the draft graph as `draft_head`
    (read when written, added to `dreaders`). Returns (module, the head rows' INT4 config or None):
    INT4 with the LM head under --quant-lm-head (the same block as the target's head), or with
    --proposal-head int4."""
    import torch


    if dspec.draft_vocab is None:  # the whole head (an INT4 LM head: `families.draft_proposes`)
        vocab = None
        rows = placeholder((tspec.vocab_size, tspec.arch.hidden_size), dtype)
        dreaders["draft_head"] = lambda: tsource.read_as(head_name(tspec), dtype)
    else:
        vocab = torch.tensor(list(dspec.draft_vocab), dtype=torch.int64)
        rows = placeholder((len(vocab), tspec.arch.hidden_size), dtype)
        dreaders["draft_head"] = lambda: torch.index_select(tsource.read_as(head_name(tspec), dtype), 0, vocab)
    if qconfig is not None and qconfig.lm_head:
        config = QuantConfig("rtn", qconfig.block, lm_head=True)
    else:
        config = proposal_head_config(proposal_head, True, qconfig, tspec.arch.hidden_size)
    return ProposingDraft.with_head(dmod, dspec.draft_vocab, rows), config


def build(
    target: str | None,
    draft: str | None,
    out: Path,
    max_seq_len: int = 2048,
    dtype: str = "fp32",
    quiet: bool = False,
    overwrite: bool = True,
    draft_vocab: str = "auto",
    quant: str = "none",
    quant_block: int | None = None,
    quant_method: str | None = None,
    quant_lm_head: bool = False,
    proposal_head: str = "full",
) -> dict:
    """Export a target/draft pair into the artifact directory `out`.

    Args:
        target: target directory or known name; None for the embedded SmolLM2-135M-Instruct.
        draft: draft directory or hub id; None for the target's released/shipped draft, or an
            untrained deterministic draft when there is none (reported in the manifest).
        out: artifact directory (replaced atomically).
        max_seq_len: KV buffer capacity in tokens (prompt + new tokens).
        dtype: "fp32" or "fp16" graph precision (norms, fc and softmax stay fp32).
        draft_vocab: "auto" proposes from the draft's `draft_vocab.json` when it has one (fewer LM-head
            rows per proposal, same output); "full" always uses the whole vocabulary.
        quant: "int4" makes the target's decoder linear layers INT4 weight-only (`quantize.py`: the
            DequantizeLinear form TensorRT and onnxruntime both load); "none" keeps `dtype` weights.
        quant_block: INT4 values per scale along K (a power of two >= 16 dividing each layer's K;
            default 128).
        quant_method: "rtn" (round to nearest, the default) or "awq" (activation-aware scales calibrated on
            models/prompts text and folded into the checkpoint before round to nearest: `awq.py`).
        quant_lm_head: with int4, quantize the LM head too (the embedding lookups keep their table).
        proposal_head: "full" (default) keeps the proposal vocabulary's head rows (`draft_vocab`) in the
            graph dtype; "int4" stores them INT4 weight-only: they only rank the draft's proposals,
            which the full-precision head then verifies, so output is unchanged while a verify reads
            8x fewer head bytes. Measured on SmolLM2 fp32, 2 cores: about 2 ms of a 45 ms verify saved
            (onnxruntime's fp32-compute INT4 kernel reads slowly), tau 1.67 -> 1.62, so not the
            default here; bandwidth-bound GPUs gain more. No effect without a proposal vocabulary.

    Returns:
        the manifest dict.

    Raises:
        DFlashError: bad input; nothing is written in that case.
    """
    import torch


    if dtype not in ("fp32", "fp16"):
        raise DFlashError(f"--dtype must be fp32 or fp16 (got {dtype!r})")
    if draft_vocab not in ("auto", "full"):
        raise DFlashError(f"--draft-vocab must be auto or full (got {draft_vocab!r})")
    if max_seq_len < 2:
        raise DFlashError(f"--max-seq-len must be at least 2 (got {max_seq_len})")
    if quant not in ("none", "int4"):
        raise DFlashError(f"--quant must be none or int4 (got {quant!r})")
    if proposal_head not in ("int4", "full"):
        raise DFlashError(f"--proposal-head must be int4 or full (got {proposal_head!r})")
    given = [flag for flag, value in (("--quant-block", quant_block), ("--quant-method", quant_method),
                                      ("--quant-lm-head", quant_lm_head or None)) if value is not None]
    if given and quant != "int4":
        raise DFlashError(f"{', '.join(given)} needs --quant int4")
    qconfig = None
    if quant == "int4":
        qconfig = QuantConfig(method="rtn" if quant_method is None else quant_method, block=128 if quant_block is None else quant_block,
                              lm_head=quant_lm_head)
    if qconfig is not None:
        qconfig.validate()
    out = Path(out).resolve()
    check_output_dir(out, overwrite)
    t_start = time.perf_counter()
    # Validation prints nothing, so bad input gives exactly one error line.
    tspec, dspec, tsource, dstate, name = prepare_pair(target, draft)
    family = target_family(tspec.family)
    family.check_options(tspec, dspec.target_layer_ids, tsource, qconfig, proposal_head)
    if draft_vocab == "full":
        dspec = replace(dspec, draft_vocab=None)
    # the manifest's source hashes read every shard once more: done on a thread while the draft and
    # the target template trace (CPU-bound, the disk idle), not after the weights are written
    hashes = SourceHashes(tspec, dspec)
    stage = Stage(total=5, quiet=quiet)
    stage.report(f"validated target and draft in {time.perf_counter() - t_start:.1f}s")
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise DFlashError(f"cannot write an artifact under {out.parent} ({exc.strerror or exc}); "
                          "choose a writable --out directory") from None
    try:
        # the draft first: its weights (held in memory) are freed before the target streams
        with stage("exporting draft.onnx"):
            dsource = WeightSource(f"draft {dspec.path or '(untrained)'}", tensors=dstate)
            dmod, dreaders = draft_export_module(dspec, dsource, torch_dtype)
            dquant = draft_quant_plan(dspec, dsource.shapes, qconfig) if qconfig is not None else None
            head_config = None
            if draft_proposes(family.DRAFT_PROPOSES, dspec, qconfig):
                dmod, head_config = _attach_proposal_head(dmod, dreaders, tspec, dspec, tsource, torch_dtype, qconfig,
                                                          proposal_head)
            rewrite = (dquant or head_config) and streaming_rewrite(
                dreaders, dsource, torch_dtype, dquant and QuantConfig("rtn", dquant["block"]),
                dquant["tensors"] if dquant else [], head_config)
            export_draft(dmod, tmp / "draft.onnx", dreaders, progress=not quiet, rewrite=rewrite)
            del dstate, dsource, dmod, dreaders
        with stage(f"exporting target.onnx ({family.EXPORT_TITLE})"):
            exported = family.export_for_build(tspec, dspec, tsource, tmp / "target.onnx", torch_dtype, qconfig,
                                               proposal_head, quiet)
        with stage("checking graphs (TensorRT 10 operators, duplicate weights)"):
            checks = {g: check_graph(tmp / f"{g}.onnx") for g in ("target", "draft")}
        with stage("writing tokenizer and manifest"):
            np.save(tmp / "mask_embedding.npy", exported.mask_row.astype(np.float32), allow_pickle=False)
            tok_info = _save_tokenizer(tspec.path, tmp / "tokenizer")
            manifest = _manifest(tspec, dspec, name, max_seq_len, dtype, checks, tok_info, tmp, hashes.result())
            if qconfig is not None:
                manifest["quantization"] = {**quantization_record(qconfig, exported.quantized, dtype, head_name(tspec)),
                                            **exported.quant_extra, **({"draft": dquant} if dquant else {})}
            head = exported.proposal_head or (head_config if proposal_head == "int4" else None)
            if head is not None:
                manifest["proposal_head"] = {"format": "int4", "method": head.method, "block": head.block}
            manifest["export_seconds"] = round(time.perf_counter() - t_start, 1)
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; an artifact is meant to be shared and copied
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            try:
                out.rename(old / out.name)
                tmp.rename(out)
            except OSError as exc:
                if (old / out.name).exists() and not out.exists():
                    (old / out.name).rename(out)  # put the previous artifact back
                raise DFlashError(f"cannot replace {out}: {exc}") from None
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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


def _manifest(tspec: TargetSpec, dspec: DraftSpec, name, max_seq_len, dtype, checks, tok_info, tmp: Path,
              hashes: dict[str, dict[str, str]]) -> dict:
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
        },
        "mask_embedding": "mask_embedding.npy",
        "stop_token_ids": stop,
        "chat_template": tok_info["chat_template"],
        "special_tokens": tok_info["special_tokens"],
        "io": {g: _io_spec(tmp / f"{g}.onnx") for g in ("target", "draft")},
        "graph_checks": checks,
        "sources": sources,
        "tools": _tool_versions(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
    }
