"""Where the target's next tokens rank among the draft's logits, per block position (PyTorch, no export).

For each held-out prompt the target decodes greedily; then, at every position t of the reply, the draft
drafts a block anchored at token t from the target's taps of the tokens up to t (what the runtime gives
it), and the rank of the target's token t + k among the draft's logits for block position k is recorded.
Prints, per position k, the share of positions where the target's token is the draft's top-1, within its
top 2, 3, 4 and 8, and the share of blocks whose first j proposals are all top-1 (what a chain verify
accepts). Top-k coverage at position 1 is what verifying k alternatives for the first proposal (tree
verification) would accept.

It also prints how well the draft's own confidence (its top-1 softmax probability at block position 1)
predicts that its first proposal is the target's token, by confidence bin: a calibrated confidence
would let a step choose its verify length after the draft call, from what the draft says of each
proposal, instead of from the running acceptance alone.

    python scripts/draft_ranks.py [--draft models/smollm2-135m-dflash] [--per-category 3] [--max-new-tokens 96] [--save ranks.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def block_ranks(model, draft, spec, ids: list[int], reply: list[int],
                block: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Per anchor position in `reply`: the ranks of the target's next tokens at block positions 1..,
    and the draft's top-1 probability (its confidence) at those positions."""
    import torch

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    seq = ids + reply
    with torch.no_grad():
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1][0] for i in spec.target_layer_ids], dim=-1)
        a, b = spec.arch, block or spec.block_size
        out, confidences = [], []
        for t in range(len(ids) - 1, len(seq) - 1):
            past = [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
            block = torch.tensor([seq[t]] + [spec.mask_token_id] * (b - 1))
            logits = head(draft(features[: t + 1], embed(block), *past)[0][: b - 1])
            truth = seq[t + 1 : t + b]
            out.append([int((logits[k] > logits[k, y]).sum()) for k, y in enumerate(truth)])
            confidences.append(torch.softmax(logits[: len(truth)].float(), dim=-1).max(dim=-1).values.tolist())
    return out, confidences


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.sources import resolve_target
    from dflash_export.train.data import first_per_category, read_prompts
    from torch_tau import _load_draft

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "smollm2-135m-dflash")
    ap.add_argument("--prompts", type=Path, default=ROOT / "models" / "prompts" / "eval.jsonl")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block", type=int, help="draft blocks of this many tokens (default: the draft's block size)")
    ap.add_argument("--save", type=Path, help="write the per-anchor ranks (a JSON list of lists) here")
    args = ap.parse_args()
    target_dir, _ = resolve_target(None)
    tspec = load_target_spec(target_dir)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, use_safetensors=True).eval()
    draft, spec = _load_draft(args.draft, tspec, None)
    ranks, confidences = [], []
    for row in first_per_category(read_prompts(args.prompts), args.per_category):
        ids = list(tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
        with torch.no_grad():
            reply = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)[0]
        r, c = block_ranks(model, draft, spec, ids, reply[len(ids):].tolist(), args.block)
        ranks, confidences = ranks + r, confidences + c
    print(f"{len(ranks)} block anchors")
    if args.save:
        args.save.write_text(json.dumps(ranks))
    by_position = defaultdict(list)
    for r in ranks:
        for k, rank in enumerate(r):
            by_position[k + 1].append(rank)
    for k in (1, 2, 3, 4):
        r = np.array(by_position[k])
        print(f"position {k}: " + ", ".join(f"top-{n} {np.mean(r < n):.3f}" for n in (1, 2, 3, 4, 8)))
    chains = np.array([next((k for k, rank in enumerate(r) if rank), len(r)) for r in ranks])
    print("first j proposals all top-1: " + ", ".join(f"j={j} {np.mean(chains >= j):.3f}" for j in (1, 2, 3, 4)))
    first_conf = np.array([c[0] for c in confidences])
    first_hit = np.array([r[0] == 0 for r in ranks])
    edges = np.linspace(0.0, 1.0, 11)
    print("position 1, draft confidence -> share of anchors, P(top-1 is the target's token):")
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (first_conf >= lo) & ((first_conf < hi) | (hi == 1.0))
        if inside.any():
            print(f"  [{lo:.1f}, {hi:.1f}{']' if hi == 1.0 else ')'} {inside.mean():.3f}  {first_hit[inside].mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
