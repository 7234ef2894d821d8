"""The straightforward PyTorch DFlash loop, the way the reference implementation runs it.

Hugging Face target with its dynamic KV cache and `output_hidden_states`, plus the PyTorch draft with
a concatenated context cache cropped every step. It is the baseline a user would otherwise run (timed by
`bench`) and an independent implementation of the decoding loop for tests.
"""

from __future__ import annotations

import inspect
import time

import torch

from dflash_export.nn.draft import DFlashDraft
from runtime.errors import DFlashError


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def torch_spec_generate(
    model,
    draft: DFlashDraft | None,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int,
    mask_token_id: int,
    stop_token_ids=(),
    verify_len: int | None = None,
    proposal_vocab: list[int] | None = None,
) -> dict:
    """Greedy DFlash speculative decoding in PyTorch (dflash-facts section 5).

    Args:
        model: a Hugging Face causal LM (fp32, eval mode).
        draft: the PyTorch draft (None with block_size 1 = plain decoding).
        prompt_ids: prompt token ids (>= 1).
        max_new_tokens: at most this many new tokens.
        block_size: tokens per block; 1 = plain decoding.
        mask_token_id: the draft's mask id.
        stop_token_ids: ids that end generation once committed.
        verify_len: verify at most this many proposals per step.
        proposal_vocab: propose from these token ids only (an artifact's `draft_vocab`), as `build`'s
            graphs do; None = the whole vocabulary.

    Returns:
        {"output_ids", "acceptance_lengths", "seconds", "margins"}: `margins[i]` is speculative step i's smallest
        top-1 minus top-2 logit gap among what decided its acceptance length (the proposals up to the
        first rejected one, and the target's posteriors for them), for comparing other runtimes' steps
        only where fp32 rounding cannot flip them.
    """
    from transformers import DynamicCache

    if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
        raise DFlashError("the PyTorch loop cannot verify on a hybrid (Gated DeltaNet) target: Hugging Face's cache "
                          "does not roll its recurrent state back after a rejected proposal")
    kw = _cache_kwarg(model)
    stops = set(stop_token_ids)
    t0 = time.perf_counter()
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    out = model(ids, use_cache=True, output_hidden_states=True, **{kw: cache})
    taps = draft.spec.target_layer_ids if draft is not None else ()

    def features(hidden_states):
        return torch.cat([hidden_states[i + 1][0] for i in taps], dim=-1) if taps else None

    tokens = [int(out.logits[0, -1].argmax())]
    context = features(out.hidden_states)
    draft_past = None
    acceptance, margins = [], []
    vocab = None if proposal_vocab is None else torch.tensor(list(proposal_vocab), dtype=torch.int64)
    n_verify = block_size - 1 if verify_len is None else min(verify_len, block_size - 1)
    while tokens[-1] not in stops and len(tokens) < max_new_tokens:
        remaining = max_new_tokens - len(tokens)
        n_prop = min(n_verify, remaining - 1)
        proposals = []
        if n_prop > 0:
            block = torch.tensor([tokens[-1]] + [mask_token_id] * (block_size - 1))
            if draft_past is None:
                a = draft.spec.arch
                draft_past = [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
            res = draft(context, embed(block), *draft_past)
            draft_past = [torch.cat([p, n]) for p, n in zip(draft_past, res[1:])]
            prop_logits = head(res[0][:n_prop])
            if vocab is not None:
                prop_logits = prop_logits[:, vocab]
            proposals = prop_logits.argmax(-1)
            proposals = (vocab[proposals] if vocab is not None else proposals).tolist()
        committed_len = len(prompt_ids) + len(tokens) - 1
        step_ids = torch.tensor([[tokens[-1]] + proposals])
        out = model(step_ids, use_cache=True, output_hidden_states=True, **{kw: cache})
        posterior = out.logits[0].argmax(-1).tolist()
        acc = 0
        while acc < len(proposals) and proposals[acc] == posterior[acc]:
            acc += 1
        if n_prop > 0:
            decided = min(acc + 1, len(proposals))
            margins.append(min([_gap(out.logits[0, j]) for j in range(acc + 1)] + [_gap(prop_logits[j]) for j in range(decided)]))
        new = proposals[:acc] + [posterior[acc]]
        for t in new:
            tokens.append(t)
            if t in stops:
                break
        surplus = cache.get_seq_length() - (committed_len + acc + 1)
        if surplus > 0:
            cache.crop(-surplus)  # negative = drop that many rows (the form every transformers version takes)
        if taps:
            context = features(out.hidden_states)[: acc + 1]
        if n_prop > 0:
            acceptance.append(acc + 1)
    return {"output_ids": tokens, "acceptance_lengths": acceptance, "seconds": time.perf_counter() - t0, "margins": margins}


def _gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])
