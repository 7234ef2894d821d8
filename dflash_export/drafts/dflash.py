"""The DFlash draft family (Chen et al., 2026; `DFlashDraftModel` checkpoints): a few transformer
layers that fill a block of masked positions in one pass, reading the target's tap features through
KV injection (`dflash_export.nn.draft`). Hooks: `dflash_export.drafts.registry`."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_export.checkpoint.draft import (
    DraftSpec,
    load_draft_spec,
    parse_draft_config,
)
from dflash_export.checkpoint.sources import random_draft_config
from dflash_export.checkpoint.target import TargetSpec, head_name
from dflash_export.checkpoint.weights import (
    WeightSource,
    bind_weights,
    empty_module,
    placeholder,
)
from dflash_export.drafts.registry import ExportedDraft
from dflash_export.export.batched import export_batched_draft
from dflash_export.export.graphs import export_draft
from dflash_export.families.registry import draft_proposes
from dflash_export.nn.batched_draft import BatchedDraft
from dflash_export.nn.draft import DFlashDraft, ProposingDraft
from dflash_export.nn.layers import cast_for_export
from dflash_export.quant.int4 import QuantConfig, draft_quant_plan
from dflash_export.quant.streaming import proposal_head_config, streaming_rewrite

ARCHITECTURES = ("DFlashDraftModel",)


def random_draft_state(spec: DraftSpec, seed: int = 0) -> dict:
    """Deterministic random-init weights for an untrained draft (normal(0, 0.02), unit norms)."""


    gen = torch.Generator().manual_seed(seed)
    module = empty_module(lambda: DFlashDraft(spec))  # names and shapes only, in state-dict order
    state = {}
    for k, v in module.state_dict().items():
        state[k] = torch.ones(v.shape) if k.endswith("norm.weight") else torch.randn(v.shape, generator=gen) * 0.02
    return state


def draft_export_module(dspec: DraftSpec, source: WeightSource, dtype) -> tuple:
    """The draft's export module in `dtype` (fc and norms fp32) with streamed weights.

    Returns:
        (DFlashDraft, {initializer name: reader}) for `export.graphs.export_draft`.
    """

    module = empty_module(lambda: DFlashDraft(dspec, dtype)).eval()
    cast_for_export(module, dtype)
    return module, bind_weights(module, source, source.where)


def proposal_head_rows(dreaders: dict, tspec: TargetSpec, vocab, tsource: WeightSource, dtype, qconfig,
                       proposal_head: str) -> tuple:
    """The target's LM head rows of proposal vocabulary `vocab` (None: all V), streamed into a draft
    graph as `draft_head` (read when written, added to `dreaders`). Returns (placeholder rows `[V', d]`,
    their INT4 config or None): INT4 with the LM head under --quant-lm-head (the same block as the
    target's head), or with --proposal-head int4."""
    if vocab is None:  # the whole head (an INT4 LM head: `families.registry.draft_proposes`)
        rows = placeholder((tspec.vocab_size, tspec.arch.hidden_size), dtype)
        dreaders["draft_head"] = lambda: tsource.read_as(head_name(tspec), dtype)
    else:
        ids = torch.tensor(list(vocab), dtype=torch.int64)
        rows = placeholder((len(ids), tspec.arch.hidden_size), dtype)
        dreaders["draft_head"] = lambda: torch.index_select(tsource.read_as(head_name(tspec), dtype), 0, ids)
    if qconfig is not None and qconfig.lm_head:
        config = QuantConfig("rtn", qconfig.block, lm_head=True)
    else:
        config = proposal_head_config(proposal_head, True, qconfig, tspec.arch.hidden_size)
    return rows, config


def _attach_proposal_head(dmod, dreaders: dict, tspec: TargetSpec, dspec: DraftSpec, tsource: WeightSource, dtype,
                          qconfig, proposal_head: str) -> tuple:
    """The draft export module ending in the proposal head (`nn.draft.ProposingDraft`) over its
    proposal vocabulary (`proposal_head_rows`). Returns (module, the head rows' INT4 config or None)."""
    rows, config = proposal_head_rows(dreaders, tspec, dspec.draft_vocab, tsource, dtype, qconfig, proposal_head)
    return ProposingDraft.with_head(dmod, dspec.draft_vocab, rows), config


def read_draft(draft_dir: Path, tspec: TargetSpec) -> tuple[DraftSpec, dict]:
    """Family hook: the spec and weights of a DFlash checkpoint for `tspec` (`load_draft_spec`)."""
    return load_draft_spec(draft_dir, tspec)


def untrained_draft(tspec: TargetSpec) -> tuple[DraftSpec, dict]:
    """Family hook: a deterministic random DFlash draft shaped for `tspec` (`random_draft_config`)."""
    dspec = parse_draft_config(random_draft_config(tspec), tspec, "(untrained)", None)
    return dspec, random_draft_state(dspec)


# This family exports a batched draft too (`build --batched`: `nn.batched_draft.BatchedDraft`).
BATCHES = True


def export_for_build(tspec: TargetSpec, dspec: DraftSpec, dstate: dict, tsource: WeightSource, path: Path, torch_dtype,
                     qconfig, proposal_head: str, target_takes_ids: bool, quiet: bool,
                     batched_path: Path | None = None) -> ExportedDraft:
    """`build`'s draft step (family hook): the draft graph at `path`, its last layer INT4 with
    `qconfig` (`draft_quant_plan`), ending in the proposal head (the target's LM head rows of its
    proposal vocabulary, streamed from `tsource`) where the target family takes proposal ids
    (`target_takes_ids`) and the draft proposes (`families.registry.draft_proposes`). With
    `batched_path`, a proposing draft's batched graph there too, reading the draft graph's weights."""
    dsource = WeightSource(f"draft {dspec.path or '(untrained)'}", tensors=dstate)
    dmod, dreaders = draft_export_module(dspec, dsource, torch_dtype)
    dquant = draft_quant_plan(dspec, dsource.shapes, qconfig) if qconfig is not None else None
    head_config = None
    if draft_proposes(target_takes_ids, dspec, qconfig):
        dmod, head_config = _attach_proposal_head(dmod, dreaders, tspec, dspec, tsource, torch_dtype, qconfig,
                                                  proposal_head)

    def rewrite():
        return (dquant or head_config) and streaming_rewrite(
            dreaders, dsource, torch_dtype, dquant and QuantConfig("rtn", dquant["block"]),
            dquant["tensors"] if dquant else [], head_config)

    export_draft(dmod, path, dreaders, progress=not quiet, rewrite=rewrite())
    batched = batched_path is not None and isinstance(dmod, ProposingDraft)
    if batched:
        export_batched_draft(BatchedDraft.view_of(dmod), batched_path, dreaders, rewrite(), weights_of=path)
    return ExportedDraft(head_config=head_config, quant_plan=dquant, batched=batched)
