"""The Qwen3 / Llama target family (`families/registry.py` hooks): its config reader (`read_target`), the dense
decoder of `nn.layers.TargetForExport`, exported with its weights streamed from the shards, and its fp32
reference for `check`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_export.checkpoint.draft import DraftSpec
from dflash_export.checkpoint.target import (
    SUPPORTED_TARGETS,
    AttentionSpec,
    TargetSpec,
    check_layer_types,
    head_name,
    read_eos_token_ids,
    refuse_quantized,
    safetensors_files,
)
from dflash_export.checkpoint.weights import (
    WeightSource,
    bind_weights,
    check_weight_names,
    empty_module,
    load_module_weights,
)
from dflash_export.export.batched import export_batched_target
from dflash_export.export.graphs import export_target
from dflash_export.families.registry import ExportedTarget, draft_proposes
from dflash_export.families.shared import upcast_weights_on_use
from dflash_export.nn.batched import BatchedTarget
from dflash_export.nn.layers import TargetForExport, cast_for_export
from dflash_export.quant import awq
from dflash_export.quant.awq import check_calibration_source
from dflash_export.quant.int4 import (
    dequantized_source,
    head_rows_dequantizer,
    quantized_names,
)
from dflash_export.quant.streaming import proposal_head_config, streaming_rewrite
from runtime.errors import DFlashError
from runtime.manifest import target_takes_ids

ARCHITECTURES = tuple(SUPPORTED_TARGETS)  # what read_target takes (the unsupported-target error lists them)
EXPORT_TITLE = "weights are read as they are written"  # build's progress line for the target step
# the RMSNorm weights are the scales themselves, as the draft's norms take them (train-draft's init)
NORM_WEIGHT_OFFSET = 0.0


def read_target(model_dir: Path, cfg: dict) -> TargetSpec | None:
    """Family hook: the TargetSpec of a Qwen3ForCausalLM / LlamaForCausalLM checkpoint (by architecture,
    else by model_type), None for a config of another family.

    Raises:
        DFlashError: a quantized checkpoint, sliding-window layers, missing or malformed fields, no
            safetensors weights.
    """
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED_TARGETS[a] for a in archs if a in SUPPORTED_TARGETS), None)
    if family is None:
        family = {"qwen3": "qwen3", "llama": "llama"}.get(cfg.get("model_type", ""))
    if family is None:
        return None
    refuse_quantized(cfg, model_dir)
    check_layer_types(cfg, f"target {model_dir}")
    arch = AttentionSpec.from_config(cfg, f"target {model_dir}")
    safetensors_files(model_dir)
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise DFlashError(f"target {model_dir} config.json has vocab_size {vocab!r}; expected a positive integer")
    return TargetSpec(
        path=model_dir,
        family=family,
        arch=arch,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=read_eos_token_ids(model_dir, cfg),
    )


def causal_lm_state_dict(state: dict) -> dict:
    """Family hook: the checkpoint's tensors under the `*ForCausalLM` names train-draft reads
    (`model.layers.N.*`, `model.embed_tokens.weight`, ...): a dense checkpoint's own names."""
    return state


def check_weights(tspec: TargetSpec, tap_layers, source: WeightSource) -> None:
    """Every parameter of the export module has a checkpoint tensor of its shape (family hook; names and
    shapes from the safetensors headers, nothing read).

    Raises:
        DFlashError: missing or unexpected names, or a shape mismatch, named.
    """
    empty = empty_module(lambda: TargetForExport(tspec, tuple(tap_layers)))  # names and shapes only
    check_weight_names({k: tuple(p.shape) for k, p in empty.named_parameters()}, source, source.where,
                       tied=empty.lm_head is None)


def check_options(tspec: TargetSpec, tap_layers, source: WeightSource, qconfig, proposal_head: str) -> None:
    """Family hook: every `build` option applies to dense targets; with `qconfig`, the INT4 block must
    divide every quantized layer's K (checked before any output exists).

    Raises:
        DFlashError: a layer whose K the block does not divide, naming --quant-block; for AWQ, missing
            calibration prompts or a tokenizer that does not load.
    """
    if qconfig is not None:
        quantized_names(source.names(), source.shapes, qconfig, head_name(tspec))
    if qconfig is not None and qconfig.method == "awq":

        check_calibration_source(tspec.path)


def manifest_fields(tspec: TargetSpec) -> dict:
    """Family hook: a dense target's rows are split-invariant (`row_exact`: each row computes the same
    floats in any call, see `nn.layers.Attention.attend`), which lets the runtime use kernels with int8
    activations and stay lossless."""
    return {"row_exact": True}


# This family exports a batched target too (`build --batched`: `nn.batched.BatchedTarget`).
BATCHES = True

# This family's target takes proposal ids from a draft that ends in the proposal head (`build`: when
# the draft has a proposal vocabulary or the LM head is INT4: `families.registry.draft_proposes`).
DRAFT_PROPOSES = True


def target_export_module(tspec: TargetSpec, dspec: DraftSpec, source: WeightSource, dtype,
                         module_class=TargetForExport, load_whole=lambda name: False,
                         draft_proposes: bool = False) -> tuple:
    """The target's export module (`module_class`: TargetForExport or a subclass with its interface)
    in `dtype` (norms fp32) with streamed weights (`weights.bind_weights`, `load_whole` passed on).
    `draft_proposes`: the module takes proposal ids and holds no proposal head rows.

    Returns:
        (module, {initializer name: reader}) for `export.graphs.export_target` or `export.graphs._export`.
    """
    extra = {"draft_proposes": True} if draft_proposes else {}
    vocab = None if draft_proposes else dspec.draft_vocab
    module = empty_module(lambda: module_class(tspec, dspec.target_layer_ids, dtype, vocab, **extra)).eval()
    cast_for_export(module, dtype)
    readers = bind_weights(module, source, f"target {tspec.path}", load_whole)
    head_rows = module.freeze_draft_head(readers.get(module.head_weight_name()))
    if head_rows is None and module.draft_head is not None:  # a head small enough to be held, not streamed
        rows = module.draft_head
        head_rows = lambda: rows  # noqa: E731
    if head_rows is not None:
        readers["draft_head"] = head_rows
    return module, readers


def export_for_build(tspec: TargetSpec, dspec: DraftSpec, tsource: WeightSource, path: Path, torch_dtype,
                     qconfig, proposal_head: str, quiet: bool, batched_path: Path | None = None) -> ExportedTarget:
    """`build`'s target step (family hook): export a Qwen3/Llama target with its weights streamed (each
    read as its initializer is written, INT4-quantized on the way when `qconfig`); with `batched_path`,
    also the batched target there, reading the target graph's weights file."""

    qnames = quantized_names(tsource.names(), tsource.shapes, qconfig, head_name(tspec)) if qconfig else []
    quant_extra = {}
    if qconfig is not None and qconfig.method == "awq":
        tsource, quant_extra = _awq_source(tspec, dspec, tsource, path.parent, torch_dtype, qconfig, quiet)
    tmod, treaders = target_export_module(tspec, dspec, tsource, torch_dtype,
                                          draft_proposes=draft_proposes(DRAFT_PROPOSES, dspec, qconfig))
    head_config = proposal_head_config(proposal_head, "draft_head" in treaders, qconfig, tspec.arch.hidden_size)
    rewrite = streaming_rewrite(treaders, tsource, torch_dtype, qconfig, qnames, head_config)
    export_target(tmod, path, treaders, progress=not quiet, rewrite=rewrite)
    if batched_path is not None:
        bmod, breaders = target_export_module(tspec, dspec, tsource, torch_dtype, module_class=BatchedTarget,
                                              draft_proposes=True)
        export_batched_target(bmod, batched_path, breaders, streaming_rewrite(breaders, tsource, torch_dtype, qconfig,
                                                                              qnames, None), weights_of=path)
    return ExportedTarget(tsource.read_row("model.embed_tokens.weight", dspec.mask_token_id).float().numpy(),
                          qnames, head_config, quant_extra)


def _awq_source(tspec: TargetSpec, dspec: DraftSpec, tsource: WeightSource, out_dir: Path, torch_dtype, qconfig,
                quiet: bool) -> tuple[WeightSource, dict]:
    """Calibrate AWQ's scales (`awq.calibrate`), write them into the artifact's directory and return the
    scaled source and the manifest fields that name them."""
    import time


    t0 = time.perf_counter()
    ids = awq.calibration_ids(tspec.path, tspec.vocab_size)
    module = empty_module(lambda: TargetForExport(tspec, tuple(dspec.target_layer_ids))).eval()
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=tspec.arch.num_layers, desc="AWQ calibration (layers)", leave=False)
    try:
        scales = awq.calibrate(module, tsource, ids, qconfig.block, torch_dtype,
                               progress=bar and (lambda i, n: bar.update(1)))
    finally:
        if bar is not None:
            bar.close()
    awq.save_scales(out_dir / awq.SCALES_FILE, scales)
    extra = {"awq_scales": awq.SCALES_FILE, "awq_calibration": {
        "prompts": "models/prompts/train*.jsonl" if awq.has_tokenizer(tspec.path) else "seeded random ids (no tokenizer)",
        "tokens": int(ids.numel()), "grid": awq.GRID,
        "seconds": round(time.perf_counter() - t0, 1)}}
    return awq.scaled_source(tsource, scales), extra


def reference_target(tspec: TargetSpec, dspec: DraftSpec, source: WeightSource, manifest: dict, vocab):
    """The fp32 reference target `check` compares the graph with (family hook): weights kept as stored
    (bf16 for most checkpoints) and upcast as they are used; an INT4 artifact's quantized weights as
    the graph computes with them (its dequantized weights)."""

    graph_dtype = {"fp32": torch.float32, "fp16": torch.float16}[manifest["dtype"]]
    if manifest.get("quantization"):  # the model the INT4 graph computes: its dequantized weights
        source = dequantized_source(source, manifest["quantization"], graph_dtype)
    proposes = target_takes_ids(manifest)
    tmod = empty_module(lambda: ReferenceTarget(tspec, dspec.target_layer_ids, torch.float32, vocab, proposes)).eval()
    set_head_transforms(tmod, manifest, graph_dtype)
    load_module_weights(tmod, source, f"target {tspec.path}")
    tmod.model.embed_tokens.register_forward_hook(lambda module, args, out: out.to(torch.float32))
    upcast_weights_on_use(tmod, skip=("model.embed_tokens.weight", tmod.head_weight_name()))  # upcast by rows
    return tmod


def set_head_transforms(tmod, manifest: dict, graph_dtype) -> None:
    """Make a reference module's LM head rows (and proposal rows) those an INT4 head computes with, as
    the artifact's manifest records them (`quantization.lm_head`, `proposal_head`); unchanged otherwise."""

    tmod.head_rows_transform = head_rows_dequantizer(manifest.get("quantization"), graph_dtype)
    proposal = manifest.get("proposal_head")  # INT4 proposal rows: rank proposals as the graph does
    tmod.proposal_rows_transform = (head_rows_dequantizer({"lm_head": True, "block": proposal["block"]}, graph_dtype)
                                    if proposal else tmod.head_rows_transform)


class ReferenceTarget(TargetForExport):
    """The target module computing in fp32 over an LM head / embedding kept as stored (bf16): the
    head is upcast a block of rows at a time, never as a whole fp32 copy (1.2 GB for Qwen3-8B)."""

    rows_per_block = 8192
    head_rows_transform = None  # rows -> the rows an INT4 head computes with (quantize.head_rows_dequantizer)
    proposal_rows_transform = None  # the same for the proposal vocabulary's rows

    def head_rows_fp32(self, rows: torch.Tensor | None = None, transform=None):
        w = self.head_weight() if rows is None else torch.index_select(self.head_weight(), 0, rows)
        transform = self.head_rows_transform if rows is None else transform
        for start in range(0, w.shape[0], self.rows_per_block):
            block = w[start:start + self.rows_per_block]
            if transform is not None:
                block = transform(block)
            yield block.to(torch.float32)

    def logits_of(self, h):
        return torch.cat([torch.matmul(h.to(torch.float32), blk.T) for blk in self.head_rows_fp32()], dim=-1)

    def proposal_scores(self, h):
        if self.draft_vocab is None:
            return self.logits_of(h)
        h = h.to(torch.float32)
        return torch.cat([torch.matmul(h, blk.T) for blk in self.head_rows_fp32(self.draft_vocab, self.proposal_rows_transform)],
                         dim=-1)
