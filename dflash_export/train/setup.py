"""The draft a `train-draft` run trains, settled before any data are generated: the target, the draft's
shape (the options, else the `--resume` state's or the `--init-from` draft's, else the defaults) and
config (`DraftPlan`), and, once the data exist, the draft module with its first weights (random, the
`--init-from` draft's, or the target's last layers) and the frozen target embeddings and LM-head rows
the loss reads (`LossHead`). Target-family differences (weight names, zero-centred norms) come from the
family's hooks (`families/registry.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_export.checkpoint.draft import (
    DraftSpec,
    build_target_layer_ids,
    load_draft_spec,
    parse_draft_config,
    read_draft_vocab,
)
from dflash_export.checkpoint.sources import (
    EMBEDDED_MASK_TOKEN_ID,
    random_draft_config,
    resolve_target,
)
from dflash_export.checkpoint.target import (
    TargetSpec,
    file_sha256,
    load_state_dict,
    read_config,
)
from dflash_export.families.registry import load_target_spec, target_family
from dflash_export.nn.draft import DFlashDraft
from dflash_export.nn.layers import load_weights
from dflash_export.train.loss import autocast_dtype, loss_vocabulary
from dflash_export.train.state import check_resume, read_resume_state
from runtime.errors import DFlashError


@dataclass
class DraftPlan:
    """What the options, the target and a `--resume` / `--init-from` source settle before any data exist.

    Attributes:
        target_dir / tspec: the target checkpoint and its validated spec.
        out: the resolved `--out`.
        taps: the target layer ids the draft reads.
        cfg / dspec: the draft's config.json (a source's own when there is one) and its parsed spec.
        settings: layers, taps, block_size, mask_token_id: what a resumed run must share with its source.
        amp_dtype: the forward's autocast dtype (torch.bfloat16) or None (fp32).
        resumed: the `--resume` state (tensors, metadata), or None.
        init_state: the `--init-from` draft (see `_load_init_draft`), or None.
    """

    target_dir: Path
    tspec: TargetSpec
    out: Path
    taps: tuple[int, ...]
    cfg: dict
    dspec: DraftSpec
    settings: dict
    amp_dtype: Any
    resumed: tuple[dict, dict] | None
    init_state: dict | None


def plan_draft(args, device) -> DraftPlan:
    """Resolve the target and the draft's shape, filling the shape options left unset (from the source,
    else the defaults), and refuse contradictions, all before any data are generated.

    Raises:
        DFlashError: an earlier run's state in --out without --resume, a shape the target cannot take, a
            --init-from draft or --resume state that contradicts the options.
    """

    target_dir, _ = resolve_target(args.target)
    tspec = load_target_spec(target_dir)
    out = Path(args.out).resolve()
    if not args.resume and (out / "train_state" / "state.safetensors").is_file():
        raise DFlashError(f"{out} holds a train-draft state (an earlier run's); pass --resume {args.out}"
                          f"{' instead of --init-from' if args.init_from else ''} to continue it, or delete it (or choose "
                          "another --out) to start over")
    # a run that continues (--resume) or fine-tunes (--init-from) takes the draft's shape from its source
    # unless told otherwise; a contradiction is refused below
    resumed = read_resume_state(Path(args.resume)) if args.resume else None
    init_state = _load_init_draft(Path(args.init_from), tspec) if args.init_from else None
    _fill_shape_options(args, (resumed[1].get("settings") if resumed else None) or (init_state["shape"] if init_state else {}))
    taps = _draft_taps(args, tspec, target_dir)
    cfg = draft_config(tspec, args.layers, taps, args.block_size, args.mask_token_id)
    dspec = parse_draft_config(cfg, tspec, "(training)", None)  # validates taps and mask id
    # (a source's own config keeps what a fresh one would change: head layout, MLP width, RoPE)
    source_cfg = init_state["config"] if init_state else (resumed[1].get("config") if resumed else None)
    # what a resumed run must share with the run it continues: the draft's shape and meaning (--steps may
    # grow, and --lr may drop after a divergence)
    settings = {"layers": args.layers, "taps": list(taps), "block_size": args.block_size, "mask_token_id": args.mask_token_id}
    if init_state is not None and _grows(init_state["shape"], settings):
        source_cfg = grown_config(init_state["config"], args.layers, taps)
    elif init_state is not None and init_state["shape"] != settings:
        theirs = init_state["shape"]
        raise DFlashError(f"--init-from {args.init_from}: that draft has --layers {theirs['layers']} --taps "
                          f"{' '.join(map(str, theirs['taps']))} --block-size {theirs['block_size']} --mask-token-id "
                          f"{theirs['mask_token_id']}, this run --layers {args.layers} --taps {' '.join(map(str, taps))} "
                          f"--block-size {args.block_size} --mask-token-id {args.mask_token_id}; drop those options to use the "
                          "draft's (only --layers and --taps may differ, and only by growing: more layers, taps that keep the draft's "
                          "in their order)")
    amp_dtype = autocast_dtype(args.amp, device)
    if resumed is not None:
        check_resume(Path(args.resume), resumed[1], settings, args, amp_dtype)
    if source_cfg is not None:  # same shape settings (checked above): its config is this run's
        cfg = source_cfg
        dspec = parse_draft_config(cfg, tspec, "(training)", None)
    return DraftPlan(target_dir=target_dir, tspec=tspec, out=out, taps=taps, cfg=cfg, dspec=dspec, settings=settings,
                     amp_dtype=amp_dtype, resumed=resumed, init_state=init_state)


def _grows(source: dict, settings: dict) -> bool:
    """Whether this run grows the `--init-from` draft: more layers and/or more taps (the draft's taps kept,
    in their order, among them), everything else its own."""
    same = all(source[k] == settings[k] for k in ("block_size", "mask_token_id"))
    kept = [t for t in settings["taps"] if t in source["taps"]] == list(source["taps"])
    more = settings["layers"] > source["layers"] or len(settings["taps"]) > len(source["taps"])
    return same and kept and settings["layers"] >= source["layers"] and more


def grown_config(config: dict, layers: int, taps) -> dict:
    """A draft config.json grown to `layers` layers (the added ones repeat the last layer's kind) reading
    `taps`."""
    cfg = dict(config, num_hidden_layers=layers)
    cfg["dflash_config"] = dict(cfg.get("dflash_config") or {}, target_layer_ids=list(taps))
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        cfg["layer_types"] = cfg["layer_types"] + [cfg["layer_types"][-1]] * (layers - len(cfg["layer_types"]))
    return cfg


def _fill_shape_options(args, source: dict) -> None:
    """Set the draft shape options left unset (None) to the source run's or draft's, else the defaults."""

    for key, default in (("layers", 2), ("taps", None), ("block_size", 16), ("mask_token_id", EMBEDDED_MASK_TOKEN_ID)):
        if getattr(args, key) is None:
            setattr(args, key, source.get(key, default))


def _draft_taps(args, tspec, target_dir: Path) -> tuple[int, ...]:
    """The target layers the draft reads (--taps, else the reference rule), checked against the target.

    Raises:
        DFlashError: the target lacks tokenizer files, or --layers / --taps do not fit its layers.
    """

    n_target = tspec.arch.num_layers
    if not any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise DFlashError(f"target {target_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                          "train-draft needs the target's tokenizer to generate its data: copy them into that directory")
    if args.layers > n_target:
        raise DFlashError(f"--layers {args.layers} exceeds the target's {n_target} layers; a draft is a few layers (2-5)")
    if args.taps and not all(0 <= t < n_target for t in args.taps):
        raise DFlashError(f"--taps {' '.join(map(str, args.taps))}: the target has layers 0..{n_target - 1}")
    taps = tuple(args.taps) if args.taps else tuple(build_target_layer_ids(n_target, args.layers))
    if len(set(taps)) < len(taps):
        raise DFlashError(f"the default taps for {args.layers} draft layers over {n_target} target layers repeat a layer "
                          f"{list(taps)}; pass distinct --taps (one per draft layer) or fewer --layers")
    return taps


def draft_config(tspec, layers: int, taps, block_size: int, mask_id: int) -> dict:
    """A fresh trained draft's config.json for `tspec`: the untrained draft's layout with these taps,
    marked trained (so `build` does not call it untrained)."""

    cfg = random_draft_config(tspec, num_layers=layers, block_size=block_size, mask_token_id=mask_id)
    cfg["dflash_config"]["target_layer_ids"] = list(taps)
    cfg["dflash_export"] = {"trained": True}
    return cfg


def _load_init_draft(source: Path, tspec) -> dict:
    """Load `--init-from` (a trained draft to fine-tune on more data with a new schedule), before any
    data are generated so a wrong source fails first.

    Returns:
        {"weights": state dict (names without "model."), "sha256": {file name: sha256} of its weights,
         "shape": {"layers", "taps", "block_size", "mask_token_id"} of the draft (the run's defaults),
         "config": its config.json, the base of the trained draft's (head layout, MLP width and RoPE may
         differ from a fresh draft's; `auto_map` is dropped, its modeling file is not copied)}.

    Raises:
        DFlashError: `source` is not a valid draft checkpoint for this target (see `load_draft_spec`).
    """

    spec, state = load_draft_spec(source, tspec)
    config = {k: v for k, v in read_config(source).items() if k not in ("auto_map", "torch_dtype", "dflash_export")}
    config["dflash_export"] = {"trained": True}
    shape = {"layers": spec.arch.num_layers, "taps": list(spec.target_layer_ids), "block_size": spec.block_size,
             "mask_token_id": spec.mask_token_id}
    return {"weights": state, "shape": shape, "config": config,
            "sha256": {f.name: file_sha256(f) for f in sorted(Path(source).glob("*.safetensors"))}}


@dataclass
class LossHead:
    """The frozen target pieces the loss reads: the embeddings of the block tokens, and the LM-head rows
    the softmax runs over (all of them, or the loss vocabulary's: see `train_loss.loss_vocabulary`).

    Attributes:
        embed: `torch.nn.Embedding` of the target's token embeddings (frozen).
        weight: fp32 `[V', d]` LM-head rows.
        vocab: int64 `[V']` ids of those rows, or None for the full vocabulary.
        label_map: int64 `[V]` full id -> row of `weight` (-1 outside), or None for the full vocabulary.
    """

    embed: Any
    weight: Any
    vocab: Any = None
    label_map: Any = None


def build_draft(args, plan: DraftPlan, sequences: list[dict], device, teacher_ids=None):
    """The draft to train (random init, then the --init-from draft's or the target's last layers) and
    the loss head, from the target's weights (loaded once, released before training).

    Returns:
        (draft module on `device`, :class:`LossHead`).
    """
    import torch


    family = target_family(plan.tspec.family)
    tstate = family.causal_lm_state_dict(load_state_dict(plan.target_dir))  # (the names training reads)
    keep = None  # a fine-tune keeps every id its source draft proposes from (its draft_vocab.json), so
    if args.init_from:  # training on less data does not shrink the proposal vocabulary
        keep = read_draft_vocab(Path(args.init_from), int(plan.tspec.vocab_size))
    head = _loss_head(tstate, args.loss_vocab, sequences, device, teacher_ids, keep)
    draft = DFlashDraft(plan.dspec).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if plan.init_state is not None and plan.init_state["shape"] != plan.settings:  # (checked: it grows)
        _init_from_target(draft, tstate, plan.tspec, args.layers, family.NORM_WEIGHT_OFFSET)
        grown = grown_weights(draft, plan.init_state["weights"], plan.init_state["shape"]["taps"], plan.taps)
        load_weights(draft, grown, f"--init-from {args.init_from}")
    elif plan.init_state is not None:
        load_weights(draft, plan.init_state["weights"], f"--init-from {args.init_from}")
    elif args.init == "target":
        _init_from_target(draft, tstate, plan.tspec, args.layers, family.NORM_WEIGHT_OFFSET)
    return draft, head


def grown_weights(draft, source: dict, source_taps=None, taps=None) -> dict:
    """The weights of `draft` (more layers and/or taps than the `source` draft) that compute what
    `source` computes: the source's weights for its layers and the shared pieces, and each added layer
    (appended, initialised from the target's layers) made a residual identity by zeroing its attention
    output and MLP down projections, so training starts from the source draft's proposals and only has to
    learn what the added layers buy (zero-initialised residual branches still get gradients through those
    projections). Added taps get zero columns in `fc` (the source's columns move to their taps' places),
    so the context the draft reads is the source's until training gives the new taps weight.

    Args:
        draft: the grown `DFlashDraft` (its added layers already initialised).
        source: the `--init-from` draft's state dict (names without "model.").
        source_taps / taps: the target layers the source and the grown draft read (None: the same).
    Returns:
        a complete state dict for `draft`.
    """
    import torch

    state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    state.update({k: v for k, v in source.items() if k in state and k != "fc.weight"})
    fc = source["fc.weight"]
    if taps is not None and list(taps) != list(source_taps):
        d = fc.shape[1] // len(source_taps)
        grown_fc = torch.zeros(fc.shape[0], d * len(taps), dtype=fc.dtype)
        for j, tap in enumerate(source_taps):
            at = list(taps).index(tap)
            grown_fc[:, at * d : (at + 1) * d] = fc[:, j * d : (j + 1) * d]
        fc = grown_fc
    state["fc.weight"] = fc.to(state["fc.weight"].dtype)
    n_source = 1 + max(int(k.split(".")[1]) for k in source if k.startswith("layers."))
    for i in range(n_source, len(draft.layers)):
        for name in (f"layers.{i}.self_attn.o_proj.", f"layers.{i}.mlp.down_proj."):
            for leaf in ("weight", "bias"):
                if name + leaf in state:
                    state[name + leaf] = torch.zeros_like(state[name + leaf])
    return state


def _loss_head(tstate: dict, loss_vocab: str, sequences: list[dict], device, teacher_ids=None,
               keep_ids: tuple[int, ...] | None = None) -> LossHead:
    """The target's embeddings and LM head (the tied embeddings where it has none), restricted to the ids
    of `sequences` (and of the target's distributions `teacher_ids`, with --distill, and `keep_ids`, the
    --init-from draft's vocabulary) with `--loss-vocab seen`."""
    import torch

    if keep_ids:
        keep = torch.tensor(list(keep_ids), dtype=torch.int64)
        teacher_ids = keep if teacher_ids is None else torch.cat([teacher_ids.reshape(-1).to(torch.int64), keep])

    embed_w = tstate["model.embed_tokens.weight"].float().to(device)
    head_w = (tstate.get("lm_head.weight", tstate["model.embed_tokens.weight"])).float()
    vocab, label_map = None, None
    if loss_vocab == "seen":
        vocab, label_map = loss_vocabulary(sequences, head_w.shape[0], teacher_ids)
        head_w, label_map = head_w[vocab].contiguous(), label_map.to(device)
    head_w = head_w.to(device)
    return LossHead(embed=torch.nn.Embedding.from_pretrained(embed_w, freeze=True), weight=head_w, vocab=vocab,
                    label_map=label_map)


def _init_from_target(draft, tstate, tspec, layers: int, norm_offset: float) -> None:
    """Initialise draft layers from the target's last layers (same shapes); q/k norms stay at one.

    `norm_offset` is the target family's `NORM_WEIGHT_OFFSET`: a Qwen3.5 hybrid stores its RMSNorm
    weights zero-centred (it scales by 1 + w, `qwen3_5.ZeroCentredRMSNorm`); the draft's norms scale by w, so
    those are copied as 1 + w (copied as stored they would zero the draft's output: a flat loss)."""
    import torch

    first = tspec.arch.num_layers - layers
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            prefix = f"model.layers.{first + i}."
            for name, p in layer.named_parameters():
                src = tstate.get(prefix + name)
                if src is not None and tuple(src.shape) == tuple(p.shape):
                    p.copy_(src.to(p.dtype) + (norm_offset if name.endswith("norm.weight") else 0.0))
        if "model.norm.weight" in tstate:
            draft.norm.weight.copy_(tstate["model.norm.weight"] + norm_offset)
