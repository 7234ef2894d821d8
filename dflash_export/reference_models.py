"""The fp32 PyTorch reference `check` compares graphs with: the exporter's own modules rebuilt from
the source checkpoints the manifest records (their SHA-256 verified first), computing in fp32 over
weights kept as stored (bf16 for most checkpoints), and over the dequantized weights of an INT4
artifact, so an INT4 graph is compared with exactly the model it defines.
"""

from __future__ import annotations

from pathlib import Path

from runtime.errors import DFlashError


def verify_sources(manifest: dict) -> tuple[str, str | None]:
    """(target path, draft path or None) recorded in the manifest, after checking that every recorded
    file still has its SHA-256.

    Raises:
        DFlashError: a checkpoint is gone or differs from the one the artifact was exported from.
    """
    from .checkpoint import file_sha256

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


def reference_modules(manifest: dict):
    """The fp32 reference modules, rebuilt from the recorded source checkpoints.

    The target keeps its weights as stored (bf16 for most checkpoints: the model's size once, not
    twice) and computes in fp32: each weight is upcast when it is used (exact for bf16 and fp16).
    """
    import torch

    from .build import prepare_pair
    from .weights import empty_module, load_module_weights

    target, draft = verify_sources(manifest)
    tspec, dspec, tsource, dstate, _ = prepare_pair(target, draft)
    if list(dspec.target_layer_ids) != list(manifest["draft"]["target_layer_ids"]):
        raise DFlashError("the source checkpoints no longer describe this artifact (draft taps differ); rebuild it")
    vocab = dspec.draft_vocab if manifest["draft"].get("draft_vocab_size") else None
    if vocab is not None and len(vocab) != manifest["draft"]["draft_vocab_size"]:
        raise DFlashError("the source checkpoints no longer describe this artifact (draft_vocab.json differs); rebuild it")
    if tspec.hybrid is not None:  # Qwen3.5: weights loaded whole, in fp32
        from .qwen3_5_target import build_module, dequantize_like_the_graph

        tmod = build_module(tspec, dspec.target_layer_ids, vocab, torch.float32)[0]
        if manifest.get("quantization"):
            dequantize_like_the_graph(tmod, manifest["quantization"], {"fp32": torch.float32, "fp16": torch.float16}[manifest["dtype"]])
        return tmod, _reference_draft(dspec, dstate)
    from .quantize import dequantized_source, head_rows_dequantizer

    graph_dtype = {"fp32": torch.float32, "fp16": torch.float16}[manifest["dtype"]]
    if manifest.get("quantization"):  # the model the INT4 graph computes: its dequantized weights
        tsource = dequantized_source(tsource, manifest["quantization"], graph_dtype)
    ReferenceTarget = _reference_target_class()
    tmod = empty_module(lambda: ReferenceTarget(tspec, dspec.target_layer_ids, torch.float32, vocab)).eval()
    tmod.head_rows_transform = head_rows_dequantizer(manifest.get("quantization"), graph_dtype)
    proposal = manifest.get("proposal_head")  # INT4 proposal rows: rank proposals as the graph does
    tmod.proposal_rows_transform = (head_rows_dequantizer({"lm_head": True, "block": proposal["block"]}, graph_dtype)
                                    if proposal else tmod.head_rows_transform)
    load_module_weights(tmod, tsource, f"target {tspec.path}")
    tmod.model.embed_tokens.register_forward_hook(lambda module, args, out: out.to(torch.float32))
    upcast_weights_on_use(tmod, skip=("model.embed_tokens.weight", tmod.head_weight_name()))  # upcast by rows
    return tmod, _reference_draft(dspec, dstate)


def _reference_draft(dspec, dstate):
    """The fp32 reference draft module with the draft's weights (upcast as they are used)."""
    import torch

    from .modules import DFlashDraft
    from .weights import WeightSource, empty_module, load_module_weights

    dmod = empty_module(lambda: DFlashDraft(dspec, torch.float32)).eval()
    dsource = WeightSource(f"draft {dspec.path or '(untrained)'}", tensors=dstate)
    upcast_weights_on_use(load_module_weights(dmod, dsource, dsource.where))
    return dmod


def _reference_target_class():
    import torch

    from .modules import TargetForExport

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

        def propose(self, draft_hidden):
            if self.draft_vocab is None:
                return torch.argmax(self.logits_of(draft_hidden), dim=-1)
            h = draft_hidden.to(torch.float32)
            sub = torch.cat([torch.matmul(h, blk.T) for blk in self.head_rows_fp32(self.draft_vocab, self.proposal_rows_transform)],
                            dim=-1)
            return torch.index_select(self.draft_vocab, 0, torch.argmax(sub, dim=-1))

    return ReferenceTarget


def upcast_weights_on_use(module, skip: tuple[str, ...] = ()):
    """Make every non-fp32 parameter of `module` (except `skip`) read as fp32 (a parametrization: the
    stored tensor stays as it is and each use makes a transient fp32 copy), so a bf16 checkpoint
    gives the fp32 reference without an fp32 copy of the whole model."""
    import torch
    from torch.nn.utils import parametrize

    class Fp32(torch.nn.Module):
        def forward(self, w):
            return w.to(torch.float32)

    for name, p in list(module.named_parameters()):
        if p.dtype != torch.float32 and name not in skip:
            owner, _, leaf = name.rpartition(".")
            parametrize.register_parametrization(module.get_submodule(owner) if owner else module, leaf, Fp32(),
                                                 unsafe=True)
    return module
