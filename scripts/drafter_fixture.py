#!/usr/bin/env python3
"""Build a fixture where each drafter wins on its own prompts (issue 50's measurement of `drafter="auto"`):
a tiny random Qwen3.5 target (3 layers, the tests' word tokenizer "t3".."t95") whose MTP head is fitted to
its continuations of one prompt group ("mtp-data": words t3..t48) and whose DFlash draft is trained by
`train-draft` on the other's ("dflash-data": t49..t95). Then, on held-out prompts of both groups:

    python scripts/drafter_fixture.py --out /tmp/drafters
    python scripts/drafter_bench.py /tmp/drafters/art --prompts /tmp/drafters/eval.jsonl --raw --rounds 3 --max-new-tokens 48

`--neither` builds instead a wider random target (hidden 512, 6 layers: steps of milliseconds, not of a
tenth of one) with a random head and build's untrained draft, where neither drafter pays on sampled text:

    python scripts/drafter_fixture.py --out /tmp/neither --neither
    python scripts/drafter_bench.py /tmp/neither/art --prompts /tmp/neither/eval.jsonl --raw --temperature 0.7

It reuses the test suite's fixtures (`tests/hybrid_fixtures.py`, `tests/runtime_fixtures.py`,
`tests/test_mtp.py`'s head fitting): run it from the repository root with the test extra installed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

GROUPS = {"mtp-data": range(3, 49), "dflash-data": range(49, 96)}


def prompts(words: range, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(words) for _ in range(6)] for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--train-prompts", type=int, default=48, help="prompts per group to fit each drafter on")
    ap.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts per group")
    ap.add_argument("--head-steps", type=int, default=300)
    ap.add_argument("--draft-steps", type=int, default=300)
    ap.add_argument("--neither", action="store_true", help="a wider target, a random head, the untrained draft")
    args = ap.parse_args()
    if args.neither:
        return neither(args.out, args.eval_prompts)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch
    from hybrid_fixtures import THREE_LAYER_TYPES, six_layer_model
    from runtime_fixtures import add_word_tokenizer
    from safetensors.torch import save_file
    from test_mtp import _fitted_head

    from dflash_export.build import BuildOptions, build
    from dflash_export.cli import main as cli

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    target = out / "target"
    torch.manual_seed(0)
    model = six_layer_model(THREE_LAYER_TYPES)
    model.save_pretrained(target, safe_serialization=True)
    add_word_tokenizer(target)
    head_prompts = torch.tensor(prompts(GROUPS["mtp-data"], args.train_prompts, 1))
    head = _fitted_head(model, args.head_steps, head_prompts)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # (tied)
    save_file({**state, **head}, str(target / "model.safetensors"), metadata={"format": "pt"})
    text = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    train = out / "dflash-train.jsonl"
    train.write_text("".join(json.dumps({"id": f"d{i}", "category": "dflash-data", "prompt": text(p)}) + "\n"
                             for i, p in enumerate(prompts(GROUPS["dflash-data"], args.train_prompts, 2))))
    held_out = [json.dumps({"id": f"{cat}{i}", "category": cat, "prompt": text(p)})
                for cat, words in GROUPS.items() for i, p in enumerate(prompts(words, args.eval_prompts, 3))]
    (out / "eval.jsonl").write_text("\n".join(held_out) + "\n")
    draft = out / "draft"
    if cli(["train-draft", "--target", str(target), "--device", "cpu", "--prompts", str(train), "--out", str(draft),
            "--max-new-tokens", "40", "--steps", str(args.draft_steps), "--batch", "4", "--anchors", "8",
            "--layers", "1", "--data-cache", str(out / "data")]) != 0:
        return 1
    build(BuildOptions(str(target), str(draft), out / "art", max_seq_len=128, overwrite=True, quiet=True))
    print(f"wrote {out / 'art'}; held-out prompts {out / 'eval.jsonl'}")
    return 0


WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_key_head_dim=64, linear_num_value_heads=8, linear_value_head_dim=64,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, num_hidden_layers=6)


def neither(out: Path, eval_prompts: int) -> int:
    """The wider random target with a random `mtp.*` head and no draft named (build's untrained one)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch
    import transformers
    from hybrid_fixtures import CONFIG, save_with_random_mtp_head, untrained_draft_dir
    from runtime_fixtures import add_word_tokenizer

    from dflash_export.build import BuildOptions, build

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**CONFIG, **WIDE})).eval()
    target = out / "target"
    save_with_random_mtp_head(model, target)
    add_word_tokenizer(target)
    text = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    (out / "eval.jsonl").write_text("".join(json.dumps({"id": f"n{i}", "category": "random", "prompt": text(p)}) + "\n"
                                            for i, p in enumerate(prompts(range(3, 96), eval_prompts, 3))))
    untrained_draft_dir(target, out / "draft")
    build(BuildOptions(str(target), str(out / "draft"), out / "art", max_seq_len=128, overwrite=True, quiet=True))
    print(f"wrote {out / 'art'}; prompts {out / 'eval.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
