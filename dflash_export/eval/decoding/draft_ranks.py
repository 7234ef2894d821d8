"""`bench ARTIFACT --draft-ranks [DRAFT ...]`: where the target's next tokens rank among a draft's logits.

PyTorch, from the artifact's source checkpoints (the Hugging Face target; the artifact's own draft, or
each DRAFT directory of the same target, e.g. two train-draft runs), no export. For each prompt the
artifact decodes plainly (its greedy reply); then, at every position p of the reply, the draft drafts
a block anchored at token p from the target's taps of the tokens before p, exactly as a decoding step
starting there gets it (`dflash_export.eval.decoding.torch_loop`), and the rank of the target's token p + k
among the draft's logits for block position k is recorded.

Per draft: the share of anchors where the target's token is the draft's top-1, within its top 2, 3, 4
and 8, at block positions 1..4 (top-k coverage at position 1 is what verifying k - 1 alternatives
there accepts: verify trees); the share of anchors whose first j proposals are all top-1 (what a chain
verify accepts); tau at every position (1 + the mean run of top-1 proposals, at most block size - 1:
the mean tokens a full-block step starting at a random position commits), overall and per category;
and how well the draft's confidence (its top-1 probability at block position 1) predicts that its
first proposal is right, by confidence bin.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from runtime.errors import DFlashError

TOP_K = (1, 2, 3, 4, 8)
POSITIONS = (1, 2, 3, 4)
CHAINS = (1, 2, 3, 4)


def load_pair(manifest: dict, drafts: list[str]):
    """(Hugging Face target, [(label, PyTorch draft, draft spec)]) from the artifact's sources: its own
    draft when `drafts` is empty, else each of `drafts` (checked against the target as build checks).

    Raises:
        DFlashError: a draft that is not a draft of this target, or a hybrid target (`linear_attention`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_export.build import prepare_pair
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.nn.layers import load_weights

    src = manifest["sources"]
    target = src["target"]["path"]
    out = []
    for label, path in ([("artifact's draft", src["draft"]["path"])] if not drafts else [(d, d) for d in drafts]):
        _tspec, dspec, _tsource, dstate, _ = prepare_pair(target, path)
        draft = DFlashDraft(dspec).eval()
        load_weights(draft, dstate, str(path))
        out.append((label, draft, dspec))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
        raise DFlashError("--draft-ranks runs the Hugging Face target without its cache; a hybrid (Gated DeltaNet) "
                          "target is not supported")
    return model, out


def block_ranks(model, draft, spec, ids: list[int], reply: list[int], block: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per anchor position p of `reply` (after `ids`): the ranks of the target's tokens p + 1.. among the
    draft's logits at block positions 1.. (at most block - 1, fewer at the reply's end), and the
    draft's top-1 probability at those positions. The draft gets the target's taps of positions < p,
    as a decoding step anchored at p does."""
    import torch

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    seq = ids + reply
    a = spec.arch
    ranks, confidences = [], []
    with torch.no_grad():
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1][0] for i in spec.target_layer_ids], dim=-1)
        for p in range(len(ids), len(seq) - 1):
            past = [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
            blk = torch.tensor([seq[p]] + [spec.mask_token_id] * (block - 1))
            truth = seq[p + 1 : p + block]
            logits = head(draft(features[:p], embed(blk), *past)[0][: len(truth)]).float()
            ranks.append([int((logits[k] > logits[k, y]).sum()) for k, y in enumerate(truth)])
            confidences.append(torch.softmax(logits, dim=-1).max(dim=-1).values.tolist())
    return ranks, confidences


def _tau(ranks: list[list[int]]) -> float:
    runs = [next((k for k, rank in enumerate(r) if rank), len(r)) for r in ranks]
    return 1.0 + float(np.mean(runs)) if runs else 1.0


def summarise(ranks: list[list[int]], confidences: list[list[float]], categories: list[str]) -> dict:
    """The figures of the module docstring from per-anchor ranks and confidences (`categories`: each
    anchor's prompt category). Positions, chains and bins no anchor reaches are left out."""
    by_pos = defaultdict(list)
    for r in ranks:
        for k, rank in enumerate(r):
            by_pos[k + 1].append(rank)
    runs = np.array([next((k for k, rank in enumerate(r) if rank), len(r)) for r in ranks])
    cats = defaultdict(list)
    for c, r in zip(categories, ranks):
        cats[c].append(r)
    first_conf = np.array([c[0] for c in confidences])
    first_hit = np.array([r[0] == 0 for r in ranks])
    edges = np.linspace(0.0, 1.0, 11)
    bins = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (first_conf >= lo) & ((first_conf < hi) | (hi == 1.0))
        if inside.any():
            bins.append({"low": round(float(lo), 1), "high": round(float(hi), 1), "share": float(inside.mean()),
                         "top1": float(first_hit[inside].mean())})
    return {
        "anchors": len(ranks),
        "top_k": {k: {n: float(np.mean(np.array(by_pos[k]) < n)) for n in TOP_K} for k in POSITIONS if by_pos[k]},
        "chain": {j: float(np.mean(runs >= j)) for j in CHAINS if len(runs)},
        "tau_all_positions": _tau(ranks),
        "tau_by_category": {c: _tau(v) for c, v in sorted(cats.items())},
        "confidence_bins": bins,
    }


def measure(sess, prompts: list[dict], encoded: list[list[int]], max_new_tokens: int, block: int,
            drafts: list[str]) -> dict:
    """{label: summary (with the raw "ranks")} per draft, on the artifact's greedy replies to `encoded`
    (blocks of `block` >= 2 tokens).

    Raises:
        DFlashError: see `load_pair`; replies of one token only (no anchor)."""
    model, pairs = load_pair(sess.manifest, drafts)
    replies = [sess.generate(ids, max_new_tokens=max_new_tokens, block_size=1, reuse_prefix=False).output_ids
               for ids in encoded]
    out = {}
    for label, draft, spec in pairs:
        ranks, confidences, categories = [], [], []
        for p, ids, reply in zip(prompts, encoded, replies):
            r, c = block_ranks(model, draft, spec, ids, reply, block)
            ranks, confidences, categories = ranks + r, confidences + c, categories + [p["category"]] * len(r)
        if not ranks:
            raise DFlashError("--draft-ranks: every reply is a single token (no anchor); raise --max-new-tokens")
        out[label] = {**summarise(ranks, confidences, categories), "ranks": ranks}
    return out


def table_lines(label: str, s: dict) -> list[str]:
    """The printed lines of one draft's summary."""
    lines = [f"{label}: {s['anchors']} anchors, tau at every position {s['tau_all_positions']:.2f} ("
             + ", ".join(f"{c} {t:.2f}" for c, t in s["tau_by_category"].items()) + ")"]
    for k, shares in s["top_k"].items():
        lines.append(f"  position {k}: " + ", ".join(f"top-{n} {v:.3f}" for n, v in shares.items()))
    lines.append("  first j proposals all top-1: " + ", ".join(f"j={j} {v:.3f}" for j, v in s["chain"].items()))
    lines.append("  position 1, draft confidence -> share of anchors, P(top-1 is the target's token):")
    for b in s["confidence_bins"]:
        lines.append(f"    [{b['low']:.1f}, {b['high']:.1f}{']' if b['high'] == 1.0 else ')'} {b['share']:.3f}  {b['top1']:.3f}")
    return lines
