"""The training forward and loss of `train-draft`: many anchor blocks of one sequence in one draft pass
(`blocks_forward`), the recipe's decayed block cross-entropy over them (`block_loss`), the reduced
softmax vocabulary it can run over (`loss_vocabulary`), and the compute dtype both the forward and the
target's data generation autocast to (`autocast_dtype`: bf16 only where the hardware multiplies bf16
natively).
"""

from __future__ import annotations

from pathlib import Path

from dflash_export.nn.layers import rope_cos_sin
from runtime.errors import DFlashError


def blocks_forward(draft, ctx_feats, block_emb, anchors):
    """Draft forward for K blocks of one sequence in one pass (training form of DFlashDraft.forward).

    Args:
        draft: a :class:`dflash_export.nn.draft.DFlashDraft`.
        ctx_feats: `[L, k*d]` fp32 tap features of the sequence (row p = position p).
        block_emb: `[K, B, d]` target embeddings of `[anchor token, MASK x (B-1)]` per block.
        anchors: int64 `[K]` anchor positions (each block sits at positions anchor..anchor+B-1).

    Returns:
        `[K, B, d]` final normed hidden states. Block i attends to context positions < anchors[i]
        and (bidirectionally) to its own B positions only; equals DFlashDraft.forward with the
        context `ctx_feats[:anchor]` for each block (tested).
    """
    import torch
    import torch.nn.functional as F


    k, b, d = block_emb.shape
    n_ctx = ctx_feats.shape[0]
    ctx = draft.hidden_norm(draft.fc(ctx_feats))
    pos_ctx = torch.arange(n_ctx, device=ctx_feats.device)
    pos_blk = (anchors[:, None] + torch.arange(b, device=anchors.device)[None, :]).reshape(-1)
    cos_c, sin_c = rope_cos_sin(pos_ctx, draft.inv_freq, draft.rope_scale)
    cos_b, sin_b = rope_cos_sin(pos_blk, draft.inv_freq, draft.rope_scale)
    ctx_visible = pos_ctx[None, :] < anchors.repeat_interleave(b)[:, None]
    block_id = torch.arange(k, device=anchors.device).repeat_interleave(b)
    mask = torch.cat([ctx_visible, block_id[:, None] == block_id[None, :]], dim=1)  # [K*B, L + K*B]
    h = block_emb.reshape(k * b, d)
    for layer in draft.layers:
        attn = layer.self_attn
        g = attn.num_heads // attn.num_kv_heads
        x = layer.input_layernorm(h)
        q = attn.query(x, cos_b, sin_b)
        kc, vc = attn.key_value(ctx, cos_c, sin_c)
        kb, vb = attn.key_value(x, cos_b, sin_b)
        keys = torch.cat([kc, kb]).transpose(0, 1).repeat_interleave(g, dim=0)
        values = torch.cat([vc, vb]).transpose(0, 1).repeat_interleave(g, dim=0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        h = h + attn.o_proj(out.transpose(0, 1).reshape(k * b, attn.num_heads * attn.head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h).view(k, b, d)


def block_loss(
    draft, head_weight, embed, seq_ids, feats, prompt_len, n_anchors, block_size, mask_id, gamma, rng, device,
    label_map=None, amp_dtype=None, teacher=None, distill=None,
):
    """Weighted block loss for one sequence: the recipe's cross-entropy on the target's tokens (dflash-facts
    section 7), or mixed with a distillation term against the target's own distribution.

    Args:
        head_weight: fp32 `[V', d]` LM-head rows the softmax runs over: the full head (V' = V), or the
            rows of the loss vocabulary (see `loss_vocabulary`), in which case `label_map` (int64 `[V]`,
            full id -> row of `head_weight`, -1 outside) maps the labels.
        amp_dtype: autocast dtype for the forward (torch.bfloat16) or None for plain fp32.
        teacher: with `distill`, the target's top-K per position of the sequence: (int `[n, K]` full ids,
            float `[n, K]` log-probabilities); row t is the distribution of the token at t.
        distill: None (hard labels), or a :class:`Distill` (term and weight).

    Returns:
        (loss tensor or None when the response is too short, number of supervised positions).
    """
    import contextlib

    import torch

    n = len(seq_ids)
    candidates = list(range(prompt_len, n - 1))  # an anchor must have at least one token after it
    if not candidates:
        return None, 0
    anchors = sorted(rng.sample(candidates, min(n_anchors, len(candidates))))
    anchors_t = torch.tensor(anchors, dtype=torch.int64, device=device)
    ids = torch.tensor(seq_ids, dtype=torch.int64, device=device)
    offs = torch.arange(block_size, device=device)
    block_ids = torch.full((len(anchors), block_size), mask_id, dtype=torch.int64, device=device)
    block_ids[:, 0] = ids[anchors_t]
    amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
    target_pos = anchors_t[:, None] + offs[None, 1:]  # [K, B-1]
    valid = target_pos < n
    labels = ids[target_pos.clamp(max=n - 1)]
    if label_map is not None:
        labels = label_map[labels]
        if bool((labels < 0).any()):
            raise DFlashError("a training label lies outside the loss vocabulary (build it from the same data)")
    with amp:
        hidden = blocks_forward(draft, feats, embed(block_ids), anchors_t)
        logits = hidden[:, 1:].reshape(-1, hidden.shape[-1]) @ head_weight.t()
    ce = torch.nn.functional.cross_entropy(logits.float(), labels.reshape(-1), reduction="none").view(labels.shape)
    if distill is not None and distill.weight > 0:
        rows = target_pos.clamp(max=n - 1).reshape(-1)
        t_ids, t_logp = (x.to(device)[rows] for x in teacher)
        if label_map is not None:
            t_ids = label_map[t_ids.long()]
            if bool((t_ids < 0).any()):
                raise DFlashError("a distribution id lies outside the loss vocabulary (build it from the same data)")
        soft = distill_term(logits.float(), t_ids.long(), t_logp.float(), distill.term).view(labels.shape)
        ce = (1 - distill.weight) * ce + distill.weight * soft
    weights = torch.exp(-(offs[1:].float() - 1) / gamma)[None, :] * valid
    return (ce * weights).sum() / weights.sum(), int(valid.sum())


class Distill:
    """The distillation part of the loss: `term` "kl" or "tv", mixed with the hard-label cross-entropy as
    (1 - weight) * CE + weight * term (weight 1: distillation alone)."""

    def __init__(self, term: str, weight: float):
        self.term, self.weight = term, float(weight)


def distill_term(logits, teacher_ids, teacher_logp, term: str):
    """Per position, the draft's distance from the target's distribution, known by its top K.

    The teacher is its top K renormalised (p over K ids; the mass outside, a few percent at K = 16 on
    the data here, is dropped). "kl": the cross-entropy -sum_k p_k log q_k, which is KL(p || q) plus
    p's entropy (a constant), so its gradients are KL's. "tv": total variation 1/2 sum |p - q| over the
    vocabulary (p is 0 outside its K ids), which bounds the acceptance a draft loses (DistillSpec,
    Zhou et al., ICLR 2024).

    Args:
        logits: fp32 `[N, V']` draft logits over the softmax rows.
        teacher_ids: int64 `[N, K]` rows of those logits; teacher_logp: fp32 `[N, K]` log-probabilities.

    Returns:
        fp32 `[N]`.
    """
    import torch

    p = torch.softmax(teacher_logp, dim=-1)
    logq = torch.log_softmax(logits, dim=-1)
    logq_k = torch.gather(logq, 1, teacher_ids)
    if term == "kl":
        return -(p * logq_k).sum(-1)
    q_k = logq_k.exp()
    return 0.5 * ((p - q_k).abs().sum(-1) + (1 - q_k.sum(-1)).clamp(min=0))


def loss_vocabulary(sequences: list[dict], vocab_size: int, extra_ids=None):
    """The token ids the training softmax runs over: every id that occurs in the training sequences.

    The draft only ever has to predict the target's own responses, so a softmax over the ids that occur
    in them gives the same gradients for the correct logit at a fraction of the LM-head cost (the rows
    grow with the data; figures: docs/training.md#speed-the-seen-token-softmax-and-bf16). The
    same idea as the reduced draft vocabularies of EAGLE-3 (Li et al., 2025) and FR-Spec (Zhao et al.,
    2025). Decoding still uses the full LM head (proposals are verified anyway).

    `extra_ids` (a tensor of ids, -1 ignored): the target distributions' ids, which distillation also needs.

    Returns:
        (int64 `[V']` sorted ids, int64 `[vocab_size]` map full id -> index in the first, -1 outside).
    """
    import torch

    seen = {t for s in sequences for t in s["ids"]}
    if extra_ids is not None:
        seen |= set(torch.unique(extra_ids).tolist()) - {-1}
    ids = sorted(seen)
    vocab = torch.tensor(ids, dtype=torch.int64)
    label_map = torch.full((vocab_size,), -1, dtype=torch.int64)
    label_map[vocab] = torch.arange(len(ids), dtype=torch.int64)
    return vocab, label_map


def autocast_dtype(choice: str, device):
    """The dtype of an `--amp` / `--gen-dtype` choice on `device`: torch.bfloat16, or None for plain fp32.

    "auto" is bf16 only where the hardware runs bf16 matmuls natively (emulated bf16 is slower than fp32).
    """
    import torch

    if choice == "fp32":
        return None
    if choice == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else None
    return torch.bfloat16 if _cpu_has_native_bf16() else None


def dtype_name(dtype) -> str:
    """Record name of a generation/autocast dtype: None (no cast) is "fp32", torch.bfloat16 "bfloat16"."""
    return "fp32" if dtype is None or str(dtype) == "torch.float32" else str(dtype).replace("torch.", "")


def _cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in the CPU flags (Linux /proc/cpuinfo); oneDNN's own bf16 check also
    accepts plain AVX-512 CPUs, where bf16 matmuls are emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
