"""`train-draft`: train a DFlash draft for a target that has none.

Recipe (published by third parties; dflash-facts section 7): the target, its embeddings and LM head are
frozen; training data are the target's OWN greedy responses to a prompt set; per sequence, random anchor
positions inside the response each start a block `[anchor token, MASK x (B-1)]` at positions
anchor..anchor+B-1 that attends bidirectionally to itself and to the target's tap features of the
positions strictly before the anchor; the loss is cross-entropy at block position k (1..B-1) predicting
token anchor+k, weighted exp(-(k-1)/gamma); AdamW, cosine schedule with warmup, gradient clipping.

The output directory is a draft in the released DFlash format (`config.json` + `model.safetensors`), which
`build --draft` loads, plus `training_record.json` and the resume state (`train_state/state.safetensors`
with weights and AdamW moments, `train_state/state.json` with step, losses and RNG state; written every
`--save-every` steps and at the end). Nothing is ever pickled.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_export.checkpoint.outputs import check_output_dir
from dflash_export.train.data import TrainingData, prepare_training_data
from dflash_export.train.prompts import DEFAULT_PROMPTS
from dflash_export.train.loss import Distill, block_loss, dtype_name
from dflash_export.train.setup import DraftPlan, LossHead, build_draft, plan_draft
from dflash_export.train.state import distill_setting, restore_train_state, save_train_state, write_draft
from runtime.errors import DFlashError

# what train-draft writes into --out: an existing --out holding anything else is refused
TRAIN_OUTPUT_FILES = ("config.json", "model.safetensors", "training_record.json", "draft_vocab.json", "train_state")


# ---------------------------------------------------------------------------------------------
# option checks: everything that can fail without a model fails before the (long) data generation
# ---------------------------------------------------------------------------------------------
def _check_train_args(args) -> None:
    """Refuse bad options before the (possibly long) data generation."""
    if args.data_cache and len(args.data_cache) != len(args.prompts):
        files = " ".join(str(f) for f in args.prompts)
        raise DFlashError(f"--data-cache names {len(args.data_cache)} "
                          f"director{'y' if len(args.data_cache) == 1 else 'ies'} for {len(args.prompts)} --prompts "
                          f"files ({files}); give one directory per prompt file, in the same order (or omit it)")
    if args.data_cache and len({Path(d).resolve() for d in args.data_cache}) < len(args.data_cache):
        raise DFlashError("--data-cache names the same directory twice; each --prompts file needs its own")
    if args.init_from and args.resume:
        raise DFlashError("--init-from and --resume exclude each other: --resume continues a run (same schedule), "
                          "--init-from starts a new one from a trained draft's weights")
    for name in ("steps", "batch", "anchors", "layers", "max_new_tokens", "gen_batch", "responses_per_prompt"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.block_size is not None and args.block_size < 2:
        raise DFlashError(f"--block-size must be at least 2 (got {args.block_size})")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise DFlashError(f"--max-prompts must be at least 1 (got {args.max_prompts})")
    if not 0.01 <= args.sample_temperature <= 100:  # (NaN fails too) below 0.01 logits / T overflow
        raise DFlashError(f"--sample-temperature must be between 0.01 and 100 (got {args.sample_temperature}); "
                          "the first response per prompt is already the greedy one")
    if not (args.lr > 0 and math.isfinite(args.lr)) or not args.gamma > 0 or not 0 <= args.warmup < 1:
        raise DFlashError("--lr and --gamma must be positive and --warmup in [0, 1)")
    if not 0 <= args.distill_weight <= 1:  # (NaN fails too)
        raise DFlashError(f"--distill-weight must be between 0 and 1 (got {args.distill_weight})")
    if args.save_every < 0:
        raise DFlashError(f"--save-every must be 0 (only at the end) or more (got {args.save_every})")
    if args.threads is not None and args.threads < 1:
        raise DFlashError(f"--threads must be at least 1 (got {args.threads}); omit it to use torch's default")
    _check_device(args.device)
    if args.resume and not (Path(args.resume) / "train_state" / "state.safetensors").is_file():
        raise DFlashError(f"--resume {args.resume}: no train_state/state.safetensors there (written every --save-every steps)")
    if args.taps and len(set(args.taps)) < len(args.taps):
        raise DFlashError(f"--taps names a layer twice ({' '.join(map(str, args.taps))}); give distinct target layer ids")
    if len({Path(f).resolve() for f in args.prompts}) < len(args.prompts):
        raise DFlashError("--prompts names the same file twice; give each prompt file once")

    # an earlier train-draft output (or its resume state) may be replaced, never a directory of other files
    check_output_dir(Path(args.out), markers=("training_record.json", "train_state/state.safetensors"),
                     kind="train-draft output, whose files train-draft would overwrite", allowed=TRAIN_OUTPUT_FILES)
    _check_data_cache_dirs(args.data_cache or [])


def _check_data_cache_dirs(dirs: list[str]) -> None:
    """Refuse a `--data-cache` that is a file or under which no directory can be created."""
    for d in dirs:  # probed now: an unusable path must fail before an hour of generation
        d = Path(d)
        if d.exists() and not d.is_dir():
            raise DFlashError(f"--data-cache {d} is a file; pass a directory")
        base = d
        while not base.exists():
            base = base.parent
        try:  # (nothing is left behind: the directory itself is only created when data are written)
            Path(tempfile.mkdtemp(prefix=".probe-", dir=base)).rmdir()
        except OSError as exc:
            raise DFlashError(f"--data-cache {d}: cannot create directories under {base} ({exc.strerror or exc}); "
                              "pass another directory") from None


def _check_device(device: str) -> None:
    """Refuse a `--device` torch cannot use here, naming the devices that exist.

    Raises:
        DFlashError: not auto/cpu/cuda[:N], CUDA requested without a CUDA build or GPU, or no GPU N.
    """
    if device in ("auto", "cpu"):
        return
    index = device[len("cuda:"):] if device.startswith("cuda:") else ("" if device == "cuda" else None)
    if index is None or (index and not index.isdigit()):
        raise DFlashError(f"--device must be auto, cpu or cuda[:N] (got {device!r})")
    import torch

    if not torch.cuda.is_available():
        raise DFlashError(f"--device {device}: this torch build sees no CUDA GPU; use --device cpu (or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise DFlashError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s), cuda:0.."
                          f"cuda:{torch.cuda.device_count() - 1}")


# ---------------------------------------------------------------------------------------------
# the training loop
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainingRun:
    """One run's moving parts: the draft, its optimizer, the anchor RNG and the losses so far.

    `updating` is True while AdamW applies a step: a Ctrl-C then leaves no consistent state to save.
    """

    args: Any
    plan: DraftPlan
    data: TrainingData
    head: LossHead
    draft: Any
    opt: Any
    rng: random.Random
    device: Any
    start_step: int = 0
    losses: list = field(default_factory=list)
    updating: bool = False

    def lr_at(self, step: int) -> float:
        """The learning rate of `step`: linear warmup over `--warmup` of the steps, then cosine decay to 0."""
        warmup = max(1, int(self.args.warmup * self.args.steps))
        if step < warmup:
            return self.args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.args.steps - warmup)
        return self.args.lr * 0.5 * (1 + math.cos(math.pi * progress))

    def optimizer_step(self, step: int) -> None:
        """One optimizer step over `--batch` random sequences.

        Raises:
            DFlashError: the run diverged (a non-finite loss, or weights beyond fp16's range).
        """
        import torch

        args = self.args
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        self.opt.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for _ in range(args.batch):
            pick = self.rng.randrange(len(self.data.sequences))
            s = self.data.sequences[pick]
            feats = self.data.features(pick).float().to(self.device)
            distill = None if args.distill == "none" else Distill(args.distill, args.distill_weight)
            loss, n = block_loss(
                self.draft, self.head.weight, self.head.embed, s["ids"], feats, s["prompt_len"], args.anchors,
                args.block_size, args.mask_token_id, args.gamma, self.rng, self.device,
                label_map=self.head.label_map, amp_dtype=self.plan.amp_dtype,
                teacher=self.data.distribution(pick) if distill else None, distill=distill,
            )
            if loss is None:
                continue
            (loss / args.batch).backward()
            total += float(loss.detach())
            count += 1
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.updating = True
        if math.isfinite(total):  # (a non-finite loss skips the update: the weights stay as they were)
            self.opt.step()
        self.losses.append(total / max(count, 1))
        self.updating = False
        # a non-finite loss, or weights beyond fp16's range (a huge --lr blows them up while the loss is
        # still finite), mean the run diverged: stop rather than write or save a broken draft
        # (a negligible share of a training step: docs/training.md#the-divergence-checks-cost-2026-12-01)
        peak = max(float(p.detach().abs().max()) for p in self.draft.parameters())
        if not math.isfinite(total) or not peak < 65504:
            raise DFlashError(f"training diverged at step {step + 1} (loss {total:.4g}, largest weight {peak:.3g}); "
                              f"lower --lr (now {args.lr}) and train again")

    def save(self, step: int) -> None:
        """Write the resume state at `step` (see `train.state.save_train_state`)."""
        save_train_state(self.plan.out, step, self.draft, self.opt, self.rng, self.losses, {
            "loss_vocab": self.args.loss_vocab, "distill": distill_setting(self.args), "amp": self.args.amp, "amp_dtype": dtype_name(self.plan.amp_dtype),
            "settings": self.plan.settings, "config": self.plan.cfg})

    def recent_loss(self) -> float:
        """The mean loss of the last 50 steps."""
        return sum(self.losses[-50:]) / max(1, len(self.losses[-50:]))


def _start_run(args, plan: DraftPlan, data: TrainingData, draft, head: LossHead, rng, device) -> TrainingRun:
    """The optimizer over the draft and, with --resume, the saved weights, moments, losses and RNG."""
    import torch

    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    run = TrainingRun(args=args, plan=plan, data=data, head=head, draft=draft, opt=opt, rng=rng, device=device)
    if plan.resumed is not None:
        run.start_step, run.losses = restore_train_state(plan.resumed, Path(args.resume), plan.settings, draft, opt, rng)
        plan.resumed = None  # (its tensors are in the draft and optimizer now)
    return run


def _train(run: TrainingRun) -> float:
    """Run the steps from `run.start_step` to `--steps`, saving the state every `--save-every` steps.

    Ctrl-C stops at the next step boundary, where the state is consistent and is saved; a second one
    stops at once. Returns the training seconds.
    """
    from tqdm import tqdm

    args = run.args
    run.draft.train()
    bar = tqdm(range(run.start_step, args.steps), desc="training draft", file=sys.stderr, initial=run.start_step,
               total=args.steps)
    t_train = time.time()
    stop_requested = []

    def on_sigint(signum, frame):
        if stop_requested:
            raise KeyboardInterrupt
        stop_requested.append(signum)

    old_handler = signal.signal(signal.SIGINT, on_sigint) if threading.current_thread() is threading.main_thread() else None
    try:
        for step in bar:
            run.optimizer_step(step)
            bar.set_postfix(loss=f"{run.recent_loss():.3f}", lr=f"{run.lr_at(step):.1e}")
            if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                run.save(step + 1)
            if stop_requested:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        bar.close()
        _save_interrupted(run)
        raise
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
    bar.close()
    return time.time() - t_train


def _save_interrupted(run: TrainingRun) -> None:
    """After Ctrl-C: save the state of the last finished step (if any) and say how to continue."""
    args = run.args
    # (not mid-update: a half-applied AdamW step is no state to resume from)
    if len(run.losses) > run.start_step and not run.updating:
        run.save(len(run.losses))
        print(f"\ntraining interrupted after step {len(run.losses)}; its state is saved: rerun the same command with "
              f"--resume {args.out}{' instead of --init-from' if args.init_from else ''} to continue", file=sys.stderr)
    else:
        print(f"\ntraining interrupted during an update; the last saved state (if any) is in {run.plan.out / 'train_state'}",
              file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def train_draft(args) -> int:
    """Run `train-draft` (see module docstring). Returns the exit status."""
    import torch

    t_start = time.time()
    _check_train_args(args)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_draft(args, device)
    data = prepare_training_data(args, plan.tspec, plan.target_dir, plan.taps, device)
    draft, head = build_draft(args, plan, data.sequences, device, data.topk_ids if args.distill != "none" else None)
    run = _start_run(args, plan, data, draft, head, rng, device)
    train_seconds = _train(run)
    run.save(args.steps)  # lets `--resume OUT --steps MORE` continue training later
    record = _training_record(run, train_seconds, time.time() - t_start)
    write_draft(draft, plan.cfg, plan.out, args, None if head.vocab is None else head.vocab.tolist(), record)
    print(f"wrote draft {plan.out} (final loss {run.recent_loss():.3f})")
    return 0


def _training_record(run: TrainingRun, train_seconds: float, total_seconds: float) -> dict:
    """`training_record.json`: how the draft was made (command, inputs and their hashes, settings, timings,
    loss curve in means of 50 steps)."""
    args, plan, data, losses = run.args, run.plan, run.data, run.losses
    return {
        "command": " ".join(["python -m dflash_export"] + sys.argv[1:]) if sys.argv else None,
        "target": str(plan.target_dir),
        "target_files_sha256": data.target_sha256,
        "prompts": [str(f) for f in data.prompt_files],
        "prompts_sha256": data.prompts_sha256,
        "max_prompts_per_file": args.max_prompts,
        "num_sequences": len(data.sequences),
        "response_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in data.sequences),
        "max_new_tokens": args.max_new_tokens,
        "responses_per_prompt": args.responses_per_prompt,
        "sample_temperature": args.sample_temperature if args.responses_per_prompt > 1 else None,
        "gen_dtype": data.gen_dtype,  # from the data themselves (a reused --data-cache may differ)
        "steps": args.steps,
        "resumed_from_step": run.start_step if args.resume else None,
        "batch": args.batch,
        "anchors_per_sequence": args.anchors,
        "block_size": args.block_size,
        "gamma": args.gamma,
        "lr": args.lr,
        "warmup_fraction": args.warmup,
        "init": f"draft {args.init_from}" if args.init_from else args.init,
        # (the source draft may later be replaced, so its weights are identified by their hash)
        "init_from_sha256": plan.init_state["sha256"] if plan.init_state else None,
        "loss_vocab": args.loss_vocab,
        "distill": args.distill,
        "distill_weight": args.distill_weight if args.distill != "none" else None,
        "loss_vocab_size": int(run.head.weight.shape[0]),
        "amp": dtype_name(plan.amp_dtype),
        "layers": args.layers,
        "target_layer_ids": list(plan.taps),
        "mask_token_id": args.mask_token_id,
        "seed": args.seed,
        "device": str(run.device),
        "data_generation_seconds": round(data.gen_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(total_seconds, 1),
        "final_loss": run.recent_loss(),
        "loss_curve": [round(sum(losses[i : i + 50]) / len(losses[i : i + 50]), 4) for i in range(0, len(losses), 50)],
    }


def register(sub) -> None:
    """Add the `train-draft` subcommand."""
    p = sub.add_parser("train-draft", help="train a DFlash draft for a target (frozen target, self-generated data)")
    p.add_argument("--target", help="target directory or known name (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output draft directory (released DFlash format)")
    p.add_argument("--prompts", nargs="+", default=[str(d) for d in DEFAULT_PROMPTS], metavar="FILE",
                   help="JSONL prompt files (default: models/prompts/train*.jsonl), or text sets (rows with \"text\" "
                        "instead of \"prompt\", read teacher-forced; scripts/make_text_set.py writes one); each file's "
                        "data are cached on their own, so adding a file reuses the others' data")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length when generating data, and a text row's length in tokens (default %(default)s)")
    p.add_argument("--gen-batch", type=int, default=64,
                   help="prompts per batched generation call (default 64; memory grows with it: every layer's "
                        "hidden states of every step are kept until the call ends)")
    p.add_argument("--gen-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="target dtype while generating data (auto: bf16 where the CPU/GPU has native bf16 matmuls)")
    p.add_argument("--responses-per-prompt", type=int, default=1,
                   help="1 greedy response per prompt, plus K-1 sampled ones (more data from the same prompts; default %(default)s)")
    p.add_argument("--sample-temperature", type=float, default=0.8, help="temperature of the sampled responses (default %(default)s)")
    p.add_argument("--data-cache", nargs="+", default=None, metavar="DIR",
                   help="where generated data are cached, one directory per --prompts file (default: under the cache dir)")
    # (None: from --init-from's draft or the --resume state, else the default named in the help)
    p.add_argument("--layers", type=int, default=None, help="draft decoder layers (default 2, or the --init-from/--resume source's)")
    p.add_argument("--taps", type=int, nargs="+", default=None, help="target layer ids (default: reference rule)")
    p.add_argument("--block-size", type=int, default=None, help="default 16, or the --init-from/--resume source's")
    p.add_argument("--mask-token-id", type=int, default=None, help="default 16 (SmolLM2 <empty_output>), or the --init-from/--resume source's")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per optimizer step (default %(default)s)")
    p.add_argument("--anchors", type=int, default=16, help="anchor blocks per sequence (default %(default)s)")
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay exp(-(k-1)/gamma) (default %(default)s)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default %(default)s)")
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps (default %(default)s)")
    p.add_argument("--init", choices=["target", "random"], default="target", help="initialise draft layers from the target's last layers, or randomly (default %(default)s)")
    p.add_argument("--loss-vocab", choices=["seen", "full"], default="seen",
                   help="softmax over the token ids seen in the training data (default, much faster) or the full vocabulary")
    p.add_argument("--distill", choices=["none", "kl", "tv"], default="none",
                   help="also train against the target's own next-token distribution (its top 16, recorded while "
                        "generating): kl (cross-entropy to it) or tv (total variation); default %(default)s")
    p.add_argument("--distill-weight", type=float, default=1.0,
                   help="with --distill: loss = (1 - W) x hard-label CE + W x the distillation term (default %(default)s)")
    p.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto",
                   help="autocast the forward to bf16 (auto: where the CPU/GPU has native bf16 matmuls)")
    p.add_argument("--seed", type=int, default=0, help="seed of anchors, sampling and init (default %(default)s)")
    p.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from a trained draft's weights with a fresh schedule; its layers, taps, block size and mask id are the defaults")
    p.add_argument("--resume", default=None, help="a run's --out whose train_state/ to continue (usually --out itself)")
    p.add_argument("--save-every", type=int, default=200, help="save the resume state every N steps (default %(default)s)")
    p.add_argument("--save-dtype", choices=["fp16", "fp32"], default="fp16", help="dtype of the saved draft weights (default %(default)s)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=train_draft)
