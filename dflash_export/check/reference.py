"""The fp32 PyTorch reference `check` compares graphs with: the exporter's own modules rebuilt from
the source checkpoints the manifest records (their SHA-256 verified first), computing in fp32 over
weights kept as stored (bf16 for most checkpoints), and over the dequantized weights of an INT4
artifact, so an INT4 graph is compared with exactly the model it defines.
"""

from __future__ import annotations

from pathlib import Path

from dflash_export.build import prepare_pair
from dflash_export.checkpoint.dflash2 import DFlash2Spec
from dflash_export.checkpoint.target import file_sha256
from dflash_export.checkpoint.weights import (
    WeightSource,
    empty_module,
    load_module_weights,
)
from dflash_export.families.registry import target_family
from dflash_export.families.shared import upcast_weights_on_use
from dflash_export.nn.dflash2 import DFlash2Draft
from dflash_export.nn.draft import DFlashDraft, DraftWithRows, ProposingDraft
from dflash_export.quant.int4 import rtn_round_trip
from runtime.errors import DFlashError
from runtime.manifest import draft_proposes, draft_rows_exported, has_draft


def verify_sources(manifest: dict) -> tuple[str, str | None]:
    """(target path, draft path or None) recorded in the manifest, after checking that every recorded
    file still has its SHA-256.

    Raises:
        DFlashError: a checkpoint is gone or differs from the one the artifact was exported from.
    """

    src = manifest.get("sources", {})
    paths = []
    for key in ("target", "draft"):
        entry = src.get(key, {})
        path = entry.get("path")
        if path is None:
            if key == "target":
                raise DFlashError("the manifest records no target checkpoint (sources.target.path); rebuild the artifact")
            paths.append(None)
            continue
        if not Path(path).is_dir():
            raise DFlashError(f"the {key} checkpoint {path} recorded in the manifest is gone; `check` rebuilds the "
                              "PyTorch reference from it (or pass --reference FILE saved where it exists)")
        for name, digest in entry.get("files", {}).items():
            f = Path(path) / name
            if not f.is_file() or file_sha256(f) != digest:
                raise DFlashError(f"{f} differs from the file the artifact was exported from (SHA-256); the reference "
                                  "would use other weights: restore it or rebuild the artifact")
        paths.append(path)
    return paths[0], paths[1]


def reference_modules(manifest: dict, artifact_dir: Path | None = None):
    """The fp32 reference modules (target, draft), rebuilt from the recorded source checkpoints (and,
    for an AWQ artifact, the scales stored in `artifact_dir`); the draft is None in an artifact built
    with `--draft none`.

    The target keeps its weights as stored (bf16 for most checkpoints: the model's size once, not
    twice) and computes in fp32: each weight is upcast when it is used (exact for bf16 and fp16).
    """

    target, draft = verify_sources(manifest)
    drafted = has_draft(manifest)
    tspec, dspec, tsource, dstate, _ = prepare_pair(target, draft if drafted else "none")
    if list(dspec.target_layer_ids) != list(manifest["draft"]["target_layer_ids"]):
        raise DFlashError("the source checkpoints no longer describe this artifact (draft taps differ); rebuild it")
    vocab = dspec.draft_vocab if manifest["draft"].get("draft_vocab_size") else None
    if vocab is not None and len(vocab) != manifest["draft"]["draft_vocab_size"]:
        raise DFlashError("the source checkpoints no longer describe this artifact (draft_vocab.json differs); rebuild it")
    quant = manifest.get("quantization") or {}
    if quant.get("awq_scales"):
        if artifact_dir is None:
            raise DFlashError("an AWQ artifact's reference needs its directory (the scales are stored there)")
        manifest = {**manifest, "quantization": {**quant, "awq_scales": str(Path(artifact_dir) / quant["awq_scales"])}}
    tmod = target_family(tspec.family).reference_target(tspec, dspec, tsource, manifest, vocab)
    if not drafted:
        return tmod, None
    if isinstance(dspec, DFlash2Spec):
        return tmod, _selector_reference(dspec, dstate, tmod)
    dmod = _reference_draft(dspec, dstate, draft_rows_exported(manifest), manifest)
    if draft_proposes(manifest):
        dmod = _proposing_reference(dmod, tmod)
    return tmod, dmod


def reference_mtp(manifest: dict):
    """The fp32 reference of the artifact's MTP head (`nn.mtp.MTPHead`, weights from the recorded target
    checkpoint, upcast as they are used), or None for an artifact without one. Call it after
    :func:`reference_modules`, which verified the checkpoint's files (they are not hashed again)."""
    import torch

    from dflash_export.nn.mtp import MTPHead

    if "mtp" not in manifest:
        return None
    tspec, _, tsource, _, _ = prepare_pair(manifest["sources"]["target"]["path"], "none")
    heads = target_family(tspec.family).mtp_source(tspec, tsource)
    module = empty_module(lambda: MTPHead(tspec.hybrid, torch.float32)).eval()
    upcast_weights_on_use(load_module_weights(module, heads, heads.where))
    return module


def _proposing_reference(dmod, tmod):
    """`dmod` (the reference draft) ending in the proposal head as the artifact's draft graph does
    (`nn.draft.ProposingDraft`), its scores from the reference target's proposal rows (fp32; INT4
    rows as the graph computes with them)."""
    import torch


    class ReferenceProposingDraft(ProposingDraft):
        def proposal_scores(self, hidden):
            return tmod.proposal_scores(hidden.to(torch.float32))

    vocab = None if tmod.draft_vocab is None else tmod.draft_vocab.tolist()  # None: the whole (INT4) head
    return ReferenceProposingDraft.with_head(dmod, vocab, None)


def _selector_reference(dspec, dstate, tmod):
    """The fp32 reference DFlash 2 draft (`nn.dflash2.DFlash2Draft`), its LM head logits from the
    reference target's head rows (fp32; INT4 rows as the graph computes with them)."""
    import torch

    class ReferenceSelectorDraft(DFlash2Draft):
        def head_scores(self, hidden):
            return tmod.proposal_scores(hidden.to(torch.float32))

    dmod = empty_module(lambda: ReferenceSelectorDraft(dspec, torch.float32)).eval()
    dsource = WeightSource(f"draft {dspec.path}", tensors=dstate)
    upcast_weights_on_use(load_module_weights(dmod, dsource, dsource.where))
    return dmod


def _reference_draft(dspec, dstate, takes_rows: bool = True, manifest: dict | None = None):
    """The fp32 reference draft module with the draft's weights (upcast as they are used), taking
    `proposal_rows` as the artifact's draft graph does (`takes_rows`) or not (older graphs); the
    weights an INT4 build quantized (`manifest["quantization"]["draft"]`) as the graph computes with
    them (dequantized in the graph dtype)."""
    import torch


    dmod = empty_module(lambda: (DraftWithRows if takes_rows else DFlashDraft)(dspec, torch.float32)).eval()
    dsource = WeightSource(f"draft {dspec.path or '(untrained)'}", tensors=dstate)
    plan = ((manifest or {}).get("quantization") or {}).get("draft")
    if plan:
        dtype = {"fp32": torch.float32, "fp16": torch.float16}[manifest["dtype"]]
        dsource = rtn_round_trip(dsource, plan["tensors"], int(plan["block"]), dtype)
    upcast_weights_on_use(load_module_weights(dmod, dsource, dsource.where))
    return dmod


