"""Fixtures that measure `drafter="auto"` against each drafter alone (issue 50): random Qwen3.5 targets
with an `mtp.*` head, built into artifacts with build's untrained DFlash draft, and held-out prompts.

    python -m dflash_export.eval.decoding.drafter_fixture OUT --kind bigram|neither
    python scripts/drafter_bench.py OUT/art --prompts OUT/eval.jsonl --raw [--temperature 0.7]

- `bigram`: every layer's output projection is zero, so the target's next token depends on the current
  token only (a bigram model over 4,096 ids, peaked by a final-norm scale of 30), and the MTP head is
  built to equal it: `fc` passes the token's normalised embedding through, its layer adds nothing, and
  `mtp.norm` is the target's. The head's proposals are then the target's own greedy tokens. Prompts:
  "fresh" (8 random ids: no text to look up, the head wins) and "copy" (the target's own 64-token greedy
  path from x, then x again: the reply repeats the prompt, and lookups, the DFlash side's, win).
- `neither`: a random target of the same width with a random head and an untrained draft: neither
  drafter pays on sampled text, where `auto` should cost little against plain decoding.

Both targets are 6 layers of hidden 512 (steps of about 3 ms on two cores, so the loop's host work is not
what is measured), without a tokenizer (token-id prompts).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

VOCAB = 4096
QWEN3_5 = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
               layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
               linear_key_head_dim=64, linear_num_value_heads=8, linear_value_head_dim=64, linear_conv_kernel_dim=4,
               tie_word_embeddings=False, eos_token_id=None,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
ZEROED = ("o_proj.weight", "out_proj.weight", "down_proj.weight")  # each layer's writes to the residual stream


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--kind", choices=("bigram", "neither"), default="bigram")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category")
    ap.add_argument("--scale", type=float, default=30.0, help="bigram: the target's final-norm scale (peakedness)")
    args = ap.parse_args(argv)
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN3_5)).eval()
    head = _random_head(model)
    if args.kind == "bigram":
        _make_bigram(model, head, args.scale)
    target = args.out / "target"
    _save(model, head, target)
    rng = random.Random(7)
    rows = [{"id": f"fresh{i}", "category": "fresh" if args.kind == "bigram" else "random",
             "prompt": [rng.randrange(4, VOCAB) for _ in range(8)]} for i in range(args.prompts)]
    if args.kind == "bigram":
        rows += [{"id": f"copy{i}", "category": "copy", "prompt": _greedy_path(model, rng.randrange(4, VOCAB), 64)}
                 for i in range(args.prompts)]
    (args.out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _build(target, args.out)
    print(f"wrote {args.out / 'art'}; prompts {args.out / 'eval.jsonl'}")
    return 0


def _random_head(model):
    """A seeded random MTP head of the target's shape (`dflash_export.nn.mtp.MTPHead`)."""
    import torch

    from dflash_export.checkpoint.hybrid import HybridSpec
    from dflash_export.nn.mtp import MTPHead

    torch.manual_seed(2)
    return MTPHead(HybridSpec.from_config(model.config.to_dict()))


def _make_bigram(model, head, scale: float) -> None:
    """Zero every layer's residual writes (target and head), so both compute norm(embed(token)) ->
    LM head; the head's fc keeps the embedding half and its final norm is the target's."""
    import torch

    d = model.config.hidden_size
    with torch.no_grad():
        for module in (model, head.layers):
            for name, p in module.named_parameters():
                if name.endswith(ZEROED):
                    p.zero_()
        model.model.norm.weight.fill_(scale - 1.0)  # (1 + w) RMSNorm
        head.fc.weight.zero_()
        head.fc.weight[:, :d] = torch.eye(d)
        head.pre_fc_norm_embedding.weight.zero_()
        head.norm.weight.copy_(model.model.norm.weight)


def _greedy_path(model, start: int, length: int) -> list[int]:
    """`start`, then the target's greedy tokens after it, `length` in all, then `start` again."""
    import torch

    path = [start]
    with torch.no_grad():
        while len(path) < length:
            path.append(int(model(input_ids=torch.tensor([path[-1:]])).logits[0, -1].argmax()))
    return path + [start]


def _save(model, head, target: Path) -> None:
    """The target's checkpoint with the head's tensors as `mtp.*` (its embedding and LM head are the target's)."""
    from safetensors.torch import save_file

    model.save_pretrained(target, safe_serialization=True)
    mtp = {f"mtp.{k}": v.detach().clone().contiguous() for k, v in head.state_dict().items()
           if not k.startswith(("model.", "lm_head"))}
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file({**state, **mtp}, str(target / "model.safetensors"), metadata={"format": "pt"})


def _build(target: Path, out: Path) -> None:
    """Build the artifact with build's deterministic untrained draft (a checkpoint with a head gets none
    unless one is named)."""
    from safetensors.torch import save_file

    from dflash_export.build import BuildOptions, build
    from dflash_export.checkpoint.sources import random_draft_config
    from dflash_export.drafts import dflash
    from dflash_export.families.registry import load_target_spec

    tspec = load_target_spec(target)
    _, state = dflash.untrained_draft(tspec)
    draft = out / "draft"
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps(random_draft_config(tspec)))
    save_file({k: v.contiguous() for k, v in state.items()}, str(draft / "model.safetensors"))
    build(BuildOptions(str(target), str(draft), out / "art", max_seq_len=192, overwrite=True, quiet=True))


if __name__ == "__main__":
    raise SystemExit(main())
