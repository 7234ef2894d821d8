"""Training-step throughput of `train-draft`: full-vocabulary softmax vs the loss vocabulary, fp32 vs bf16.

Prints supervised block positions per second for each setting and the ratio to the fp32 full-vocabulary
baseline, all measured in this process on the same random data (timings do not depend on the values).
Sizes default to the shipped pair (SmolLM2-135M target: d 576, vocab 49152; 2-layer draft, block 16;
6061 ids in the loss vocabulary of the shipped training data), so no checkpoint is needed.

    python scripts/train_speed.py [--steps 3] [--batch 8] [--anchors 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> int:
    import torch

    from dflash_export.checkpoint.target import AttentionSpec
    from dflash_export.checkpoint.draft import DraftSpec
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.train.loss import autocast_dtype, block_loss

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--loss-vocab", type=int, default=6061)
    ap.add_argument("--seq-len", type=int, default=220, help="prompt + response tokens per sequence")
    ap.add_argument("--response", type=int, default=108)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = args.hidden
    arch = AttentionSpec(hidden_size=d, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                         intermediate_size=1536, rms_norm_eps=1e-5, rope={"rope_type": "default", "rope_theta": 100000.0},
                         attention_bias=False, mlp_bias=False, raw={})
    spec = DraftSpec(path=None, arch=arch, block_size=16, mask_token_id=16, target_layer_ids=(1, 27), taps_declared=True)
    draft = DFlashDraft(spec)
    head = torch.randn(args.vocab, d) * 0.02
    embed = torch.nn.Embedding.from_pretrained(head, freeze=True)
    vocab = torch.randperm(args.vocab)[: args.loss_vocab].sort().values
    label_map = torch.full((args.vocab,), -1, dtype=torch.int64)
    label_map[vocab] = torch.arange(len(vocab))
    seqs = [vocab[torch.randint(0, len(vocab), (args.seq_len,))].tolist() for _ in range(16)]
    feats = [torch.randn(args.seq_len, 2 * d) for _ in seqs]
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-5)
    cpu = torch.device("cpu")
    bf16 = autocast_dtype("auto", cpu)

    def rate(reduced: bool, amp) -> float:
        rng = random.Random(0)
        w, lm = (head[vocab].contiguous(), label_map) if reduced else (head, None)
        rows, t0 = 0, 0.0
        for step in range(args.steps + 1):
            if step == 1:
                rows, t0 = 0, time.perf_counter()
            opt.zero_grad(set_to_none=True)
            for _ in range(args.batch):
                i = rng.randrange(len(seqs))
                loss, n = block_loss(draft, w, embed, seqs[i], feats[i], args.seq_len - args.response, args.anchors,
                                     16, 16, 7.0, rng, cpu, label_map=lm, amp_dtype=amp)
                (loss / args.batch).backward()
                rows += n
            opt.step()
        return rows / (time.perf_counter() - t0)

    settings = [("full vocabulary, fp32", False, None), (f"loss vocabulary ({args.loss_vocab}), fp32", True, None)]
    if bf16 is not None:
        settings += [("full vocabulary, bf16", False, bf16), (f"loss vocabulary ({args.loss_vocab}), bf16", True, bf16)]
    else:
        print("(no native bf16 matmuls here: bf16 rows skipped, as `--amp auto` would)")
    base = None
    print(f"{'setting':34s} {'positions/s':>12s} {'vs baseline':>12s}")
    for name, reduced, amp in settings:
        r = rate(reduced, amp)
        base = base or r
        print(f"{name:34s} {r:12.0f} {r / base:11.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
