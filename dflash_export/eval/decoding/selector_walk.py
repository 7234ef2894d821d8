"""Where DFlash 2's selector walk runs: inside the draft graph, or on the host over codebooks in RAM.

Exports one random DFlash 2 draft of a real width twice: (a) the graph `build` writes (walk unrolled in
the graph, proposals out); (b) the same graph stopped before the walk (the LM head's top-k candidates,
their logits and the projected hidden rows out), followed by the walk in numpy over the codebooks. Both
run interleaved on onnxruntime (CPU); medians of the call (+ host walk) times are printed.

    python -m dflash_export.eval.decoding.selector_walk [--hidden 2048 --vocab 151936 --block 16 --rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _spec(hidden: int, vocab: int, block: int, layers: int, rank: int, top_k: int):
    from dflash_export.checkpoint.dflash2 import DFlash2Spec
    from dflash_export.checkpoint.target import AttentionSpec

    heads = max(1, hidden // 128)
    arch = AttentionSpec(hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers, num_heads=heads,
                         num_kv_heads=max(1, heads // 4), head_dim=128, rms_norm_eps=1e-6,
                         rope={"rope_type": "default", "rope_theta": 1e7}, attention_bias=False, mlp_bias=False, raw={})
    return DFlash2Spec(path=None, arch=arch, block_size=block, mask_token_id=0, target_layer_ids=(0,),
                       taps_declared=True, layer_types=("sliding_attention",) * layers, sliding_window=2048,
                       causal_layers=(False,) * layers, selector_rank=rank, selector_top_k=top_k, vocab_size=vocab)


def _modules(spec, seed: int = 0):
    import torch

    from dflash_export.nn.dflash2 import DFlash2Draft

    class BeforeWalk(DFlash2Draft):
        """(b): the candidates, their logits and the projected rows; the walk is the host's."""

        def forward(self, context_hidden, block_embeddings, proposal_rows, anchor_ids, *past):
            hidden, *new_kv = self.hidden_rows(context_hidden, block_embeddings, *past)
            unary, candidates = torch.topk(self.logits(hidden), self.candidate_selector.top_k, dim=-1)
            projected = self.candidate_selector.hidden_projection(hidden)
            return (candidates, unary, projected + proposal_rows.sum() * 0 + anchor_ids.sum() * 0, *new_kv)

    torch.manual_seed(seed)
    full = DFlash2Draft(spec).eval()
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
        full.with_head(torch.randn(spec.vocab_size, spec.arch.hidden_size) * 0.02)
    before = BeforeWalk(spec).eval()
    before.load_state_dict(full.state_dict())
    before.with_head(full.draft_head)
    return full, before


def host_walk(candidates, unary, projected, anchor: int, before_book, after_book) -> np.ndarray:
    """The selector's argmax walk in numpy: (ids `[N]`) from the graph's candidates `[N, k]`, logits
    `[N, k]` and projected rows `[N, r]`, over the codebooks `[V, r]`."""
    out, previous = np.empty(len(candidates), np.int64), anchor
    for j in range(len(candidates)):
        scores = unary[j] + (after_book[candidates[j]] @ (before_book[previous] * projected[j]))
        previous = int(candidates[j, int(np.argmax(scores))])
        out[j] = previous
    return out


def measure(hidden: int, vocab: int, block: int, layers: int, rank: int, top_k: int, rounds: int, past: int) -> dict:
    """Median seconds of (a) one draft call with the walk in the graph and (b) the call before the walk
    plus the host walk, and whether both choose the same ids."""
    import onnxruntime as ort

    from dflash_export.export.graphs import export_selector_draft

    spec = _spec(hidden, vocab, block, layers, rank, top_k)
    full, before = _modules(spec)
    books = [full.candidate_selector.predecessor_codebook.detach().numpy(),
             full.candidate_selector.successor_codebook.detach().numpy()]
    with tempfile.TemporaryDirectory() as tmp:
        export_selector_draft(full, Path(tmp) / "a.onnx")
        export_selector_draft(before, Path(tmp) / "b.onnx", head_names=["candidates", "unary", "projected"])
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sessions = [ort.InferenceSession(str(Path(tmp) / f"{g}.onnx"), opts, providers=["CPUExecutionProvider"])
                    for g in ("a", "b")]
    rng = np.random.default_rng(0)
    a = spec.arch
    feed = {"context_hidden": rng.standard_normal((1, hidden), np.float32),
            "block_embeddings": rng.standard_normal((block, hidden), np.float32) * 0.02,
            "proposal_rows": np.arange(block - 1, dtype=np.int64), "anchor_ids": np.array([7], np.int64)}
    for i in range(layers):
        for kind in ("key", "value"):
            feed[f"past_{kind}_{i}"] = rng.standard_normal((past, a.num_kv_heads, a.head_dim), np.float32)
    times = {"graph": [], "host": []}
    same = True
    for r in range(rounds + 2):
        t0 = time.perf_counter()
        ids_graph = sessions[0].run(["draft_top_ids"], feed)[0][:, 0]
        t1 = time.perf_counter()
        cand, unary, proj = sessions[1].run(["candidates", "unary", "projected"], feed)
        ids_host = host_walk(cand, unary, proj, 7, *books)
        t2 = time.perf_counter()
        same &= bool(np.array_equal(ids_graph, ids_host))
        if r >= 2:  # two warm-up rounds
            times["graph"].append(t1 - t0)
            times["host"].append(t2 - t1)
    return {"graph_ms": 1e3 * statistics.median(times["graph"]), "host_ms": 1e3 * statistics.median(times["host"]),
            "same_ids": same, "codebook_bytes": 2 * vocab * rank * 4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="draft layers (the walk's cost does not depend on them)")
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--past", type=int, default=256, help="cached context rows")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    r = measure(args.hidden, args.vocab, args.block, args.layers, args.rank, args.top_k, args.rounds, args.past)
    print(f"hidden {args.hidden}, vocab {args.vocab}, block {args.block}, rank {args.rank}, top-{args.top_k}: "
          f"walk in the graph {r['graph_ms']:.2f} ms per draft call; graph before the walk + host walk "
          f"{r['host_ms']:.2f} ms (x{r['host_ms'] / r['graph_ms']:.2f}); same ids: {r['same_ids']}; the host walk "
          f"needs the codebooks in host memory too ({r['codebook_bytes'] / (1 << 20):.0f} MiB fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
