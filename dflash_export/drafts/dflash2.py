"""The DFlash 2 draft family (`DFlash2DraftModel` checkpoints, z-lab/dflash 2026-08): DFlash's layers
wrapped in grouped dynamic convolutions, and a candidate selector that chooses each block position's
token among the target LM head's top candidates given the token chosen before it
(`dflash_export.nn.dflash2`). Hooks: `dflash_export.drafts.registry`.

The draft graph always ends in its proposals (the target's LM head moves into it; the target takes
proposal ids), and the selector's walk runs inside it, unrolled over the block: one graph call gives
the proposals, no codebook lives on the host.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_export.checkpoint.dflash2 import DFlash2Spec, load_dflash2_spec
from dflash_export.checkpoint.target import TargetSpec
from dflash_export.checkpoint.weights import WeightSource, bind_weights, empty_module
from dflash_export.drafts.dflash import proposal_head_rows
from dflash_export.drafts.registry import ExportedDraft
from dflash_export.export.graphs import export_selector_draft
from dflash_export.nn.dflash2 import DFlash2Draft
from dflash_export.nn.layers import cast_for_export
from dflash_export.quant.streaming import streaming_rewrite
from runtime.errors import DFlashError

ARCHITECTURES = ("DFlash2DraftModel",)


def read_draft(draft_dir: Path, tspec: TargetSpec) -> tuple[DFlash2Spec, dict]:
    """Family hook: the spec and weights of a DFlash 2 checkpoint for `tspec` (`load_dflash2_spec`)."""
    return load_dflash2_spec(draft_dir, tspec)


def untrained_draft(tspec: TargetSpec):
    """Family hook: DFlash 2 has no untrained default (build without --draft makes a DFlash v1 draft)."""
    raise DFlashError("DFlash 2 drafts come from a checkpoint: pass --draft DIR (without it, build makes an "
                      "untrained DFlash draft)")


def draft_export_module(dspec: DFlash2Spec, source: WeightSource, dtype) -> tuple:
    """The DFlash 2 export module in `dtype` (fc and norms fp32) with streamed weights: (module,
    {initializer name: reader})."""
    module = empty_module(lambda: DFlash2Draft(dspec, dtype)).eval()
    cast_for_export(module, dtype)
    return module, bind_weights(module, source, source.where)


def export_for_build(tspec: TargetSpec, dspec: DFlash2Spec, dstate: dict, tsource: WeightSource, path: Path,
                     torch_dtype, qconfig, proposal_head: str, target_takes_ids: bool, quiet: bool) -> ExportedDraft:
    """`build`'s draft step (family hook): the DFlash 2 graph at `path`, ending in the target's LM head
    (streamed from `tsource`; INT4 under --quant-lm-head) and the selector. The draft's own layers stay
    in the graph dtype under --quant int4: every layer runs over the whole block (the convolution reads
    the row before), so v1's INT4 last layer on the verified rows does not apply."""
    dsource = WeightSource(f"draft {dspec.path}", tensors=dstate)
    module, readers = draft_export_module(dspec, dsource, torch_dtype)
    rows, head_config = proposal_head_rows(readers, tspec, None, tsource, torch_dtype, qconfig, proposal_head)
    module.with_head(rows)
    rewrite = head_config and streaming_rewrite(readers, dsource, torch_dtype, None, [], head_config)
    export_selector_draft(module, path, readers, progress=not quiet, rewrite=rewrite)
    return ExportedDraft(head_config=head_config, quant_plan=None)


def reference_module(dspec: DFlash2Spec, dstate: dict, head: torch.Tensor) -> DFlash2Draft:
    """An fp32 DFlash 2 module with the checkpoint's weights and LM head rows `head [V, d]` (for `check`
    and tests)."""
    from dflash_export.nn.layers import load_weights

    module = DFlash2Draft(dspec, torch.float32).eval()
    load_weights(module, dstate, f"draft {dspec.path}")
    return module.with_head(head.float())
