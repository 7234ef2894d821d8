"""Acceptance length (tau) of drafts with the PyTorch loop, no export: compare checkpoints quickly.

Runs greedy DFlash decoding (`dflash_export.eval.torch_loop`, Hugging Face target + PyTorch draft) over the
first N prompts per category of a prompt file and prints tau overall and per category for each draft.
A draft is a released-format directory or a `train_state/state.safetensors` of a `train-draft` run
(layers, taps, block size and mask id then come from the options).

    python scripts/torch_tau.py DRAFT [DRAFT ...] [--prompts models/prompts/eval.jsonl] [--per-category 2]
           [--max-new-tokens 64] [--target DIR] [--layers 2] [--taps 1 27] [--block-size 16] [--mask-token-id 16]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path


def _load_draft(path: Path, tspec, args):
    from safetensors.torch import load_file

    from dflash_export.checkpoint.draft import load_draft_spec, parse_draft_config
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.nn.layers import load_weights
    from dflash_export.train.setup import draft_config

    if path.is_dir():
        spec, state = load_draft_spec(path, tspec)
    else:
        taps = tuple(args.taps)
        spec = parse_draft_config(draft_config(tspec, args.layers, taps, args.block_size, args.mask_token_id), tspec, str(path), None)
        state = {k[len("model."):]: v for k, v in load_file(str(path)).items() if k.startswith("model.")}
    draft = DFlashDraft(spec).eval()
    load_weights(draft, {k: v.float() for k, v in state.items()}, str(path))
    return draft, spec


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.sources import resolve_target
    from dflash_export.eval.torch_loop import torch_spec_generate
    from dflash_export.train.data import read_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+", type=Path)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "models" / "prompts" / "eval.jsonl"))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 27])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mask-token-id", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, _ = resolve_target(args.target)
    tspec = load_target_spec(target_dir)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, use_safetensors=True).eval()
    by_cat = defaultdict(list)
    for row in read_prompts(Path(args.prompts)):
        if len(by_cat[row["category"]]) < args.per_category:
            by_cat[row["category"]].append(row)
    for path in args.drafts:
        draft, spec = _load_draft(path, tspec, args)
        t0, taus, every = time.perf_counter(), {}, []
        for cat, rows in by_cat.items():
            acc = []
            for row in rows:
                ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
                with torch.no_grad():
                    out = torch_spec_generate(model, draft, list(ids), args.max_new_tokens, spec.block_size,
                                              spec.mask_token_id, tspec.eos_token_ids)
                acc += out["acceptance_lengths"]
            taus[cat] = round(sum(acc) / len(acc), 2)
            every += acc
        print(f"{path}: tau {sum(every) / len(every):.2f} {taus} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
