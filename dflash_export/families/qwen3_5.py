"""The DFlash target graph of a Qwen3.5 hybrid: `nn.layers.TargetForExport`'s interface over the hybrid
stack of `qwen3_5.Qwen35TargetForExport`.

Inputs: `input_ids [T]`, `draft_hidden [N, d]`, `temperature [1]`, `uniform [U]` as for Qwen3 targets,
then each layer's caches in layer order (`qwen3_5.cache_names`): full attention `past_key_i` /
`past_value_i`; Gated DeltaNet `conv_state_i`, `recurrent_state_i`, `pending_qkv_i`, `pending_a_i`,
`pending_b_i`. Outputs: `next_ids`, `proposal_ids`, `next_embeddings`, `logits`, `taps`, then each layer's
cache outputs. One call takes T + N <= `gated_delta.MAX_ROWS` rows (and at most as many pending rows):
the runtime feeds longer prompts in chunks (`max_call_rows` in the manifest).

`build` streams the weights as for Qwen3 targets (`export_for_build`): each is read from its shard when
its initializer is written. The few the graph derives new constants from are loaded first: the norms
(`1 + weight`), A_log and dt_bias (small, `weights.STREAM_MIN_ELEMENTS`) and the conv kernels, whose
columns the optimizer folds (`_derived_in_graph`). Layer replication traces a 4-layer template ([GDN,
attention, GDN, attention]) and copies its layers (`replication_layout`; the folded constants are
computed again per layer by `folded_constants`).

As the Qwen3.5 family (`families/registry.py` hooks) it also recognises and reads the hybrid checkpoints
(`read_target`, over `checkpoint/hybrid.py`) and tells `train-draft` their weight names and zero-centred norms.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dflash_export.checkpoint.hybrid import (
    HYBRID_ARCHITECTURES,
    HybridSpec,
    hybrid_kind,
    parse_hybrid_config,
)
from dflash_export.checkpoint.target import (
    TargetSpec,
    read_eos_token_ids,
    refuse_quantized,
    safetensors_files,
)
from dflash_export.checkpoint.weights import (
    bind_weights,
    check_weight_names,
    empty_module,
    load_module_weights,
)
from dflash_export.export.batched import batched_hybrid_inputs, export_batched_hybrid
from dflash_export.export.graphs import export_target
from dflash_export.export.replication import Layout
from dflash_export.families.dense import (
    ReferenceTarget,
    set_head_transforms,
    target_export_module,
)
from dflash_export.families.registry import ExportedTarget, draft_proposes
from dflash_export.families.shared import upcast_weights_on_use
from dflash_export.nn.batched_hybrid import BatchedHybridTarget, batched_hybrid_io_names
from dflash_export.nn.gated_delta import MAX_ROWS
from dflash_export.nn.layers import TargetForExport
from dflash_export.nn.qwen3_5 import (
    Qwen35TargetForExport,
    ZeroCentredRMSNorm,
    cache_names,
    text_state_dict,
    text_weight_name,
)
from dflash_export.quant.int4 import dequantized_source, quantized_names
from dflash_export.quant.streaming import proposal_head_config, streaming_rewrite
from runtime.errors import DFlashError
from runtime.manifest import target_takes_ids

ARCHITECTURES = tuple(HYBRID_ARCHITECTURES)  # what read_target takes (the unsupported-target error lists them)
EXPORT_TITLE = "weights are read as they are written"  # build's progress line for the target step
# the RMSNorm weights are stored zero-centred (the norm scales by 1 + w, `qwen3_5.ZeroCentredRMSNorm`),
# so a draft norm initialised from one (train-draft) takes 1 + w
NORM_WEIGHT_OFFSET = 1.0


# A draft with a proposal vocabulary returns hidden rows the hybrid target ranks itself (chains only);
# with an INT4 LM head the draft ends in the proposal head (`families.registry.draft_proposes`).
DRAFT_PROPOSES = False

# This family exports a batched target too (`build --batched`: `nn.batched_hybrid.BatchedHybridTarget`, one
# Gated DeltaNet state per slot).
BATCHES = True


def read_target(model_dir: Path, cfg: dict) -> TargetSpec | None:
    """Family hook: the TargetSpec of a dense Qwen3.5/3.6 hybrid checkpoint (`Qwen3_5ForCausalLM` or
    `Qwen3_5ForConditionalGeneration`; its `arch`: the full-attention layers' sizes), None for a config
    of another family.

    Raises:
        DFlashError: a mixture-of-experts variant (refused by name), a quantized checkpoint, a missing or
            malformed field, no safetensors weights.
    """
    kind = hybrid_kind(cfg)  # refuses mixture-of-experts variants by name
    if kind is None:
        return None
    hybrid = parse_hybrid_config(cfg, kind, f"target {model_dir}")
    refuse_quantized(cfg, model_dir)
    safetensors_files(model_dir)
    return TargetSpec(path=model_dir, family="qwen3_5", arch=hybrid.attention_spec(), vocab_size=hybrid.vocab_size,
                      tie_word_embeddings=hybrid.tie_word_embeddings, eos_token_ids=read_eos_token_ids(model_dir, cfg),
                      hybrid=hybrid)


def causal_lm_state_dict(state: dict) -> dict:
    """Family hook: the checkpoint's tensors under the `*ForCausalLM` names train-draft reads: a
    Qwen3_5ForConditionalGeneration's text weights renamed (`qwen3_5.text_state_dict`)."""
    return text_state_dict(state)


class HybridDFlashTarget(Qwen35TargetForExport):
    """A Qwen3.5 target with TargetForExport's DFlash inputs and outputs (see the module docstring).

    The proposal, sampling and embedding logic is TargetForExport's own (borrowed below): it needs
    only `head_weight`, `model.embed_tokens`, `spec.vocab_size` and `body(ids, caches)`, which the
    hybrid stack provides, so both target families run exactly the same head.
    """

    forward = TargetForExport.chain_forward  # a recurrent state cannot verify a tree: chains only
    head = TargetForExport.head
    _outputs = TargetForExport._outputs
    propose = TargetForExport.propose
    proposal_scores = TargetForExport.proposal_scores
    logits_of = TargetForExport.logits_of
    head_weight_name = TargetForExport.head_weight_name
    freeze_draft_head = TargetForExport.freeze_draft_head

    def __init__(self, spec: TargetSpec | HybridSpec, tap_layers: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 draft_vocab=None, draft_proposes: bool = False):
        super().__init__(spec if isinstance(spec, HybridSpec) else spec.hybrid, tap_layers)
        self.draft_proposes = draft_proposes  # takes proposal ids, else ranks the draft's hidden rows
        vocab = None if draft_vocab is None else torch.tensor(list(draft_vocab), dtype=torch.int64)
        self.register_buffer("draft_vocab", vocab, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)
        self.compute_dtype = dtype


class HybridMTPTarget(HybridDFlashTarget):
    """The hybrid DFlash target graph that also returns every row's final post-norm hidden state
    (`final_hidden [T + N, d]`, the last output): what the MTP head (`nn.mtp`) reads. Built where the
    artifact has the head."""

    def forward(self, input_ids, proposals, temperature, uniform, *past):
        proposal_ids = proposals if self.draft_proposes else self.propose(proposals)
        ids = torch.cat([input_ids, proposal_ids], dim=0)
        h, tap_features, new_caches = self.body(ids, past)
        outs = self._outputs(self.head(h, input_ids.shape[0], proposal_ids, temperature, uniform, tap_features, new_caches))
        return (*outs, h)


def io_names(module: HybridDFlashTarget) -> tuple[list[str], list[str]]:
    """Input and output names of the hybrid DFlash target graph, in positional order."""
    ins = ["input_ids", "proposal_ids" if module.draft_proposes else "draft_hidden", "temperature", "uniform"]
    outs = ["next_ids", *([] if module.draft_proposes else ["proposal_ids"]), "next_embeddings", "logits", "taps"]
    for i, kind in enumerate(module.spec.layer_types):
        cin, cout = cache_names(kind, i)
        ins, outs = ins + cin, outs + cout
    return ins, outs + (["final_hidden"] if isinstance(module, HybridMTPTarget) else [])


def export_inputs(module: HybridDFlashTarget) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace with: T=3, N=4, U=5, P=9, pending 6 (distinct and
    >= 2, so the exporter specialises no dimension)."""
    s, dt = module.spec, module.compute_dtype
    t, n, p, pp = 3, 4, 9, 6
    caches, dyn = [], []
    P = torch.export.Dim("past_len", min=0, max=1 << 20)
    Pp = torch.export.Dim("pending_rows", min=0, max=MAX_ROWS)
    for kind in s.layer_types:
        if kind == "full_attention":
            caches += [torch.randn(p, s.num_kv_heads, s.head_dim, dtype=dt) for _ in range(2)]
            dyn += [{0: P}, {0: P}]
        else:
            caches += [torch.randn(s.conv_kernel - 1, s.conv_dim, dtype=dt),
                       torch.randn(s.num_v_heads, s.key_head_dim, s.value_head_dim) * 0.1,
                       torch.randn(pp, s.conv_dim, dtype=dt), torch.randn(pp, s.num_v_heads, dtype=dt),
                       torch.randn(pp, s.num_v_heads, dtype=dt)]
            dyn += [None, None, {0: Pp}, {0: Pp}, {0: Pp}]
    proposals = torch.randint(0, s.vocab_size, (n,)) if module.draft_proposes else torch.randn(n, s.hidden_size, dtype=dt)
    args = (torch.randint(0, s.vocab_size, (t,)), proposals,
            torch.zeros(1, dtype=torch.float32), torch.rand(n + 1, dtype=torch.float32), *caches)
    T = torch.export.Dim("new_tokens", min=1, max=MAX_ROWS)
    N = torch.export.Dim("proposals", min=0, max=MAX_ROWS - 1)
    U = torch.export.Dim("sampled_rows", min=0, max=MAX_ROWS)
    return args, io_names(module), ({0: T}, {0: N}, None, {0: U}, tuple(dyn))


def replication_layout(module: HybridDFlashTarget):
    """The hybrid's `export.replication.Layout`: GDN and full-attention layers with their caches
    (`qwen3_5.cache_names`), traced by `export_inputs`, with the constants the optimizer folds from a
    layer's weights (`folded_constants`)."""

    spec = module.spec

    def make_template(kinds, taps):
        return type(module)(replace(spec, layer_types=tuple(kinds)), taps, module.compute_dtype,
                            draft_proposes=module.draft_proposes)

    return Layout(kinds=tuple(spec.layer_types), cache_names=cache_names, make_template=make_template,
                  export_inputs=export_inputs, io_names=io_names, folded=folded_constants, whole=_derived_in_graph)


def batched_replication_layout(module: BatchedHybridTarget):
    """The batched hybrid's `export.replication.Layout`: `replication_layout`'s, traced and named as the
    batched graph (`export.batched.batched_hybrid_inputs`)."""

    def make_template(kinds, taps):
        return BatchedHybridTarget(replace(module.spec, layer_types=tuple(kinds)), taps, module.compute_dtype)

    return Layout(kinds=tuple(module.spec.layer_types), cache_names=cache_names, make_template=make_template,
                  export_inputs=batched_hybrid_inputs, io_names=lambda m: batched_hybrid_io_names(m.spec.layer_types),
                  folded=folded_constants, whole=_derived_in_graph)


def folded_constants(layer) -> list[tuple[str, np.ndarray]]:
    """The constants the graph optimizer folds from a hybrid decoder layer's weights, as it computes them
    (numpy, in the parameters' dtypes): `1 + w` of each zero-centred norm (fp32), the conv kernel's K
    columns, and `exp(A_log)` and `-exp(A_log)` (fp32). `export.replication` recognises them by value in
    the template and computes them again for each layer."""
    out = []
    for name, sub in layer.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, ZeroCentredRMSNorm):
            w = sub.weight.detach().to(torch.float32).numpy()
            out.append((f"{prefix}weight", np.float32(1.0) + w))
    gdn = getattr(layer, "linear_attn", None)
    if gdn is not None:
        conv = gdn.conv1d.weight.detach().numpy()
        out += [("linear_attn.conv1d.weight", np.ascontiguousarray(conv[:, 0, j])) for j in range(conv.shape[2])]
        decay = np.exp(gdn.A_log.detach().to(torch.float32).numpy())
        out += [("linear_attn.A_log", decay), ("linear_attn.A_log", -decay)]
    return out


def check_weights(tspec: TargetSpec, tap_layers, source) -> None:
    """Every parameter of the hybrid export module has a checkpoint tensor of its shape, before anything
    is exported (`weights.check_weight_names` on the text weights).

    Raises:
        DFlashError: missing or unexpected names, or a shape mismatch, named.
    """

    empty = empty_module(lambda: HybridDFlashTarget(tspec, tuple(tap_layers)))
    check_weight_names({k: tuple(p.shape) for k, p in empty.named_parameters()}, source.renamed(text_weight_name),
                       source.where, tied=empty.lm_head is None)


def export_hybrid_target(module: HybridDFlashTarget, path: Path, replicate: str = "auto") -> None:
    """Trace and write the hybrid DFlash target graph of a module holding its weights (`export.graphs.export_target`:
    dynamo, opset 20, optimized, shared-input GEMMs packed; `replicate` as there). `build` streams the
    weights instead (`export_for_build`)."""

    export_target(module, Path(path), replicate=replicate, layout=replication_layout(module))


def check_options(tspec: TargetSpec, tap_layers, source, qconfig, proposal_head: str) -> None:
    """Family hook: refuse what hybrids lack (AWQ) and, with `qconfig`, an INT4 block that does not
    divide a quantized layer's K (the LM head's too with --quant-lm-head), before any output exists.

    Raises:
        DFlashError: naming the option.
    """

    if qconfig is not None and qconfig.method == "awq":
        raise DFlashError("--quant-method awq supports dense Llama / Qwen3 targets only; use --quant-method rtn "
                          "for Qwen3.5 hybrids")
    if qconfig is not None:
        _quantized_names(empty_module(lambda: HybridDFlashTarget(tspec, tuple(tap_layers))), qconfig)


def _quantized_names(module: HybridDFlashTarget, qconfig) -> list[str]:
    """The module's weights `--quant int4` stores as INT4 (`quant.int4.quantized_names`: the LM head too
    with `qconfig.lm_head`; raises on a block that does not divide a layer's K)."""

    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    return quantized_names(list(shapes), shapes, qconfig, module.head_weight_name())


def _derived_in_graph(name: str) -> bool:
    """Weights the graph computes new constants from (the conv kernel's K columns): loaded whole, so
    the optimizer folds real values (a few 10k elements per layer), not a streamed placeholder."""
    return name.endswith("conv1d.weight")


def export_for_build(tspec: TargetSpec, dspec, source, path: Path, dtype: torch.dtype, qconfig, proposal_head: str,
                     quiet: bool, batched_path: Path | None = None, final_hidden: bool = False) -> ExportedTarget:
    """`build`'s target step for a hybrid (family hook; fp32 or fp16, INT4 with `qconfig`): the graph at
    `path`, each weight read from its shard (a ConditionalGeneration's under its text name) when its
    initializer is written, INT4-quantized on the way, as for Qwen3 targets; with `batched_path`, also the
    batched hybrid target (`nn.batched_hybrid`) there, reading the target graph's weights file. With
    `final_hidden`, the target graph also returns its rows' final hidden states (`HybridMTPTarget`)."""

    text = source.renamed(text_weight_name)
    # a batched build's draft proposes ids (the batched graph verifies ids), so the target takes them too
    proposes = draft_proposes(DRAFT_PROPOSES or batched_path is not None or final_hidden, dspec, qconfig)
    module_class = HybridMTPTarget if final_hidden else HybridDFlashTarget
    module, readers = target_export_module(tspec, dspec, text, dtype, module_class, _derived_in_graph, proposes)
    names = _quantized_names(module, qconfig) if qconfig is not None else []
    head_config = proposal_head_config(proposal_head, "draft_head" in readers, qconfig, tspec.hybrid.hidden_size)
    rewrite = streaming_rewrite(readers, text, dtype, qconfig, names, head_config)
    export_target(module, Path(path), readers, progress=not quiet, rewrite=rewrite, layout=replication_layout(module))
    if batched_path is not None:
        bmod, breaders = target_export_module(tspec, dspec, text, dtype, BatchedHybridTarget, _derived_in_graph, True)
        export_batched_hybrid(bmod, batched_path, breaders, streaming_rewrite(breaders, text, dtype, qconfig, names, None),
                              weights_of=path, layout=batched_replication_layout(bmod))
    return ExportedTarget(text.read_row("model.embed_tokens.weight", dspec.mask_token_id).float().numpy(), names,
                          head_config)


def reference_target(tspec: TargetSpec, dspec, source, manifest: dict, vocab) -> HybridDFlashTarget:
    """The fp32 reference `check` compares the graph with (family hook): the export module computing in
    fp32 over the weights as stored (bf16 for most checkpoints: each is upcast when used, the LM head
    a block of rows at a time as for Qwen3, so the model is held once), an INT4 artifact's quantized
    weights as the graph computes with them."""

    # (with both drafters the graph also returns `final_hidden`: the reference returns it too)
    outputs = [o["name"] for o in manifest.get("io", {}).get("target", {}).get("outputs", [])]
    base = HybridMTPTarget if "final_hidden" in outputs else HybridDFlashTarget

    class HybridReference(base):  # ReferenceTarget's row-blocked fp32 head on the hybrid stack
        rows_per_block = ReferenceTarget.rows_per_block
        head_rows_fp32, logits_of = ReferenceTarget.head_rows_fp32, ReferenceTarget.logits_of
        proposal_scores = ReferenceTarget.proposal_scores

    text = source.renamed(text_weight_name)
    graph_dtype = {"fp32": torch.float32, "fp16": torch.float16}[manifest["dtype"]]
    if manifest.get("quantization"):  # the model the INT4 graph computes: its dequantized weights
        text = dequantized_source(text, manifest["quantization"], graph_dtype)

    proposes = target_takes_ids(manifest)
    tmod = empty_module(lambda: HybridReference(tspec, tuple(dspec.target_layer_ids), torch.float32,
                                                None if proposes else vocab, proposes)).eval()
    set_head_transforms(tmod, manifest, graph_dtype)  # an INT4 LM head / proposal rows as the graph has them
    load_module_weights(tmod, text, f"target {tspec.path}")
    tmod.model.embed_tokens.register_forward_hook(lambda module, args, out: out.to(torch.float32))
    return upcast_weights_on_use(tmod, skip=("model.embed_tokens.weight", tmod.head_weight_name()))


def manifest_fields(tspec: TargetSpec) -> dict:
    """Family hook: `hybrid_manifest_fields` of the target's HybridSpec."""
    return hybrid_manifest_fields(tspec.hybrid)


def hybrid_manifest_fields(h) -> dict:
    """A hybrid target's extra manifest fields (`manifest["target"]`): what the runtime needs for its
    recurrent state (`runtime.graphs.recurrent`) and its per-call row limit."""
    return {"layer_types": list(h.layer_types), "max_call_rows": MAX_ROWS, "rotary_dim": h.rotary_dim,
            "gdn": {"conv_kernel": h.conv_kernel, "conv_dim": h.conv_dim, "num_key_heads": h.num_k_heads,
                    "num_value_heads": h.num_v_heads, "key_head_dim": h.key_head_dim,
                    "value_head_dim": h.value_head_dim}}


# ---- the multi-token-prediction head (`nn.mtp`) ------------------------------------------------------
def mtp_source(tspec: TargetSpec, source):
    """Family hook: the checkpoint's MTP head as a WeightSource under `nn.mtp.MTPHead` names (with the
    target's embedding and LM head), or None where the checkpoint has no `mtp.*` tensors.

    Raises:
        DFlashError: `mtp_num_hidden_layers` other than 1, or `mtp.*` tensors missing, unexpected or
            mis-shaped (named), before any output exists.
    """
    from dflash_export.nn.mtp import MTPHead, mtp_weight_name

    if not any(n.startswith("mtp.") for n in source.names()):
        return None
    where = f"the MTP head (mtp.*) of {tspec.path}"
    layers = tspec.hybrid.raw.get("mtp_num_hidden_layers", 1)
    stored = {n.split(".")[2] for n in source.names() if n.startswith("mtp.layers.") and n.count(".") > 2}
    if layers != 1 or len(stored) > 1:
        raise DFlashError(f"{where}: mtp_num_hidden_layers is {layers} ({len(stored)} stored layers); only one-layer heads "
                          "are exported (Qwen3.5 / Qwen3.6 ship one; vLLM cycles several per chained step). Build "
                          "with --no-mtp to leave the head out")
    heads = source.renamed(mtp_weight_name)
    module = empty_module(lambda: MTPHead(tspec.hybrid))
    check_weight_names({k: tuple(p.shape) for k, p in module.named_parameters()}, heads, where,
                       tied=module.lm_head is None)
    return heads


def export_mtp_for_build(tspec: TargetSpec, heads, path: Path, dtype: torch.dtype, weights_of: Path | None) -> list[str]:
    """`build`'s MTP step (family hook): the head of `mtp_source` at `path` in `dtype` (norms, the fc and
    the RoPE frequencies fp32), each weight read from its shard when its initializer is written (the
    target's embedding and LM head not at all where they link to the target graph's data file).
    Returns the names linked."""
    from dflash_export.export.mtp import export_mtp
    from dflash_export.nn.layers import cast_for_export
    from dflash_export.nn.mtp import MTPHead

    module = cast_for_export(empty_module(lambda: MTPHead(tspec.hybrid, dtype)).eval(), dtype)
    readers = bind_weights(module, heads, f"the MTP head of {tspec.path}")
    return export_mtp(module, Path(path), weights_of, readers)
