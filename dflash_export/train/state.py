"""What `train-draft` keeps on disk besides its data: the resume state and the finished draft. The state
(`OUT/train_state/state.safetensors`: weights and AdamW moments, with step, losses, RNG state and the
run's settings as JSON in its metadata; `state.json` is a readable copy) is written every `--save-every`
steps, on Ctrl-C and at the end, each time as one file replaced whole, so a kill at any point leaves a
state to resume from. The draft (`config.json`, `model.safetensors`, `training_record.json`, and
`draft_vocab.json` after a reduced-vocabulary run) is written into a temporary directory and moved in.
Nothing is ever pickled.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from dflash_export.checkpoint.draft import DRAFT_VOCAB_FILE
from dflash_export.checkpoint.target import share_permissions
from dflash_export.train.loss import dtype_name
from runtime.errors import DFlashError

# the state's safetensors metadata key holding the JSON of step, losses, RNG state and settings
STATE_METADATA_KEY = "dflash_export.train.state"


def save_train_state(out: Path, step: int, draft, opt, rng, losses: list[float], run_fields: dict) -> None:
    """Write the resume state of a run at `step` into `out/train_state/`.

    Args:
        draft / opt / rng: the draft, its AdamW optimizer and the `random.Random` drawing anchors.
        losses: the loss of every step so far.
        run_fields: what a resume checks the run against, stored after step, losses and RNG state:
            "loss_vocab", "amp", "amp_dtype", "settings" (the draft's shape) and "config" (its config.json).
    """
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    params = list(draft.parameters())
    for i, (name, _) in enumerate(draft.named_parameters()):
        moments = opt.state.get(params[i])
        if moments:
            tensors[f"exp_avg.{name}"] = moments["exp_avg"].cpu().contiguous()
            tensors[f"exp_avg_sq.{name}"] = moments["exp_avg_sq"].cpu().contiguous()
    rs = rng.getstate()
    meta = json.dumps({"step": step, "losses": losses, "rng": [rs[0], list(rs[1]), rs[2]], **run_fields})
    _replace_state_files(out / "train_state", tensors, meta)


def _replace_state_files(sdir: Path, tensors: dict, meta: str) -> None:
    """Replace `sdir/state.safetensors` (tensors + `meta`) and its readable copy `sdir/state.json`."""
    from safetensors.torch import save_file

    # a subdirectory, so checkpoint loaders that read every *.safetensors at the top level ignore it
    sdir.mkdir(exist_ok=True)
    # one file, replaced whole, holds weights, moments and step: a kill at any point leaves a consistent state
    # (state.json is a readable copy only)
    try:
        save_file(tensors, str(sdir / ".state.tmp"), metadata={STATE_METADATA_KEY: meta})
        share_permissions(sdir / ".state.tmp")
        (sdir / ".state.tmp").replace(sdir / "state.safetensors")
        (sdir / ".state.json.tmp").write_text(meta)
        share_permissions(sdir / ".state.json.tmp")
        (sdir / ".state.json.tmp").replace(sdir / "state.json")
    finally:
        for tmp in (sdir / ".state.tmp", sdir / ".state.json.tmp"):
            tmp.unlink(missing_ok=True)


def read_resume_state(rdir: Path) -> tuple[dict, dict]:
    """Read `rdir/train_state/state.safetensors` (weights, AdamW moments and, since the state is one
    file, the step metadata; older states keep that in `state.json` beside it).

    Returns:
        (tensors, metadata dict with "step", "losses", "rng", ...).

    Raises:
        DFlashError: the state is missing, unreadable or torn.
    """
    from safetensors import SafetensorError, safe_open

    state_file = rdir / "train_state" / "state.safetensors"
    try:
        with safe_open(str(state_file), "pt") as f:
            raw = (f.metadata() or {}).get(STATE_METADATA_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(raw if raw is not None else (rdir / "train_state" / "state.json").read_text())
        meta["step"], meta["rng"]  # noqa: B018 (present in every state this project writes)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise DFlashError(f"--resume {rdir}: its train_state is unreadable ({type(exc).__name__}: {exc}); "
                          "start over without --resume") from None
    return tensors, meta


def check_resume(rdir: Path, meta: dict, settings: dict, args, amp_dtype) -> None:
    """Refuse a `--resume` whose saved run differs from this one in the draft's shape or meaning, loss
    vocabulary or compute dtype, or is already at `--steps` (checked before any data generation).

    Raises:
        DFlashError: naming the option and the saved run's value.
    """
    for key, now in settings.items():
        before = meta.get("settings", {}).get(key, now)  # (states written before settings were stored: weights' shapes only)
        if before != now:
            shown = " ".join(map(str, before)) if isinstance(before, list) else before
            raise DFlashError(f"--resume {rdir}: that run used --{key.replace('_', '-')} {shown} (this one "
                              f"{' '.join(map(str, now)) if isinstance(now, list) else now}); drop the option or pass the same")
    if meta.get("loss_vocab", "full") != args.loss_vocab:  # (states before this option: full)
        raise DFlashError(f"--resume {rdir}: that run used --loss-vocab {meta.get('loss_vocab', 'full')}; pass the same to resume it")
    if meta.get("distill", "none") != distill_setting(args):  # (states before this option: none)
        raise DFlashError(f"--resume {rdir}: that run used --distill {meta.get('distill', 'none')} (this one "
                          f"{distill_setting(args)}); pass the same --distill and --distill-weight to resume it")
    # the resolved autocast dtype, not the option: "auto" may mean bf16 on one machine and fp32 on another
    before = meta.get("amp_dtype")
    if before is None and meta.get("amp", args.amp) != args.amp:  # (states before the dtype was stored: the option)
        raise DFlashError(f"--resume {rdir}: that run used --amp {meta['amp']}; pass the same to resume it")
    if before is not None and before != dtype_name(amp_dtype):
        raise DFlashError(f"--resume {rdir}: that run computed in {before}, this one would in {dtype_name(amp_dtype)} "
                          f"(--amp {args.amp} here); pass --amp {'fp32' if before == 'fp32' else 'bf16'} to resume it")
    if meta["step"] >= args.steps:
        raise DFlashError(f"--resume {rdir}: that run is already at step {meta['step']}; pass --steps above it "
                          "to train longer (the cosine schedule stretches to the new length)")


def restore_train_state(resumed: tuple[dict, dict], rdir: Path, settings: dict, draft, opt, rng) -> tuple[int, list]:
    """Load a state read by :func:`read_resume_state` into the draft, its AdamW moments and the anchor RNG.

    Returns:
        (the step it was saved at, the losses of the steps before it).

    Raises:
        DFlashError: the saved weights do not fit this draft (names the options that shaped it).
    """
    import torch

    tensors, meta = resumed
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    own = draft.state_dict()
    if set(weights) != set(own) or any(tuple(weights[k].shape) != tuple(own[k].shape) for k in own):
        raise DFlashError(f"--resume {rdir}: its weights do not fit a draft with --layers {settings['layers']} --taps "
                          f"{' '.join(map(str, settings['taps']))} --block-size {settings['block_size']}; pass that run's options")
    draft.load_state_dict(weights)
    opt_state = opt.state_dict()
    for i, (name, _) in enumerate(draft.named_parameters()):
        if f"exp_avg.{name}" in tensors:
            opt_state["state"][i] = {"step": torch.tensor(float(meta["step"])), "exp_avg": tensors[f"exp_avg.{name}"],
                                     "exp_avg_sq": tensors[f"exp_avg_sq.{name}"]}
    opt.load_state_dict(opt_state)
    # (JSON turned the state's inner tuple into a list)
    rng.setstate(tuple(meta["rng"][:1]) + (tuple(meta["rng"][1]),) + tuple(meta["rng"][2:]))
    return meta["step"], meta.get("losses", [])


def write_draft(draft, cfg: dict, out: Path, args, draft_vocab: list[int] | None, record: dict) -> None:
    """Write config.json + model.safetensors + training_record.json (+ draft_vocab.json, the ids the
    loss ran over, from which `build` lets the draft propose) atomically into `out`.

    Raises:
        DFlashError: a weight is not finite in `--save-dtype` (the run diverged); nothing is written.
    """
    import torch
    from safetensors.torch import save_file


    dtype = torch.float16 if args.save_dtype == "fp16" else torch.float32
    cfg = dict(cfg)
    cfg["torch_dtype"] = "float16" if dtype == torch.float16 else "float32"
    out.parent.mkdir(parents=True, exist_ok=True)
    for left in out.parent.glob(f".{out.name}.tmp-*"):  # of a run killed (SIGKILL) while writing
        shutil.rmtree(left, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.state_dict().items()}
        bad = [k for k, v in state.items() if not bool(v.isfinite().all())]
        if bad:  # e.g. weights blown up to ~1e30 by a huge --lr: finite in fp32, inf in fp16
            raise DFlashError(f"the trained weights {bad[:3]}{' ...' if len(bad) > 3 else ''} are not finite in "
                              f"{args.save_dtype}: the run diverged; lower --lr (now {args.lr}) and train again")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "training_record.json").write_text(json.dumps(record, indent=2))
        names = ["config.json", "model.safetensors", "training_record.json"]
        if draft_vocab is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps({"format": "dflash_export.draft_vocab", "token_ids": draft_vocab}))
            names.append(DRAFT_VOCAB_FILE)
        elif (out / DRAFT_VOCAB_FILE).exists():
            (out / DRAFT_VOCAB_FILE).unlink()  # a full-vocabulary run replaces an earlier reduced one
        share_permissions(tmp)
        for name in names:
            out.mkdir(parents=True, exist_ok=True)
            (tmp / name).replace(out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def distill_setting(args) -> str:
    """The run's distillation objective as its resume state records it: "none", or "<term> <weight>"."""
    return "none" if args.distill == "none" else f"{args.distill} {args.distill_weight:g}"
