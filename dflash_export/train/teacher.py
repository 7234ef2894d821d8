"""The target's own next-token distribution, recorded while `train-draft` generates its data, for
distillation (`--distill`): a forward hook on the LM head keeps each step's top K, and each sequence's
rows are aligned with its tokens."""

from __future__ import annotations

# the target's distribution kept per response position: its 16 most likely ids and their
# log-probabilities, from the logits generation computes anyway
DISTILL_TOPK = 16


class TopKRecorder:
    """A forward hook on the target's LM head that records, at every generation step, the target's `k`
    most likely next ids and their log-probabilities, from the raw logits of each sequence's last
    position (the plain distribution, before any sampling warper, whatever order a transformers
    version applies those in).

    Generation computes the target's whole next-token distribution at every response position; training
    on hard labels keeps one token of it. `stacked()` returns int32 ids and fp16 log-probabilities
    `[batch, steps, k]`.
    """

    def __init__(self, k: int):
        self.k, self.steps = k, []

    def hook(self, module, inputs, logits):
        import torch

        logp = torch.log_softmax(logits[:, -1].float(), dim=-1)
        values, ids = torch.topk(logp, self.k, dim=-1)
        self.steps.append((ids.to(torch.int32).cpu(), values.to(torch.float16).cpu()))

    def stacked(self):
        import torch

        return torch.stack([i for i, _ in self.steps], dim=1), torch.stack([v for _, v in self.steps], dim=1)


def rows_of_distribution(ids, logp, prompt_len: int, n: int):
    """One sequence's distribution rows aligned with its tokens: row t holds the target's top-k for the token
    at position t (from generation step t - prompt_len); prompt rows have ids -1 and log-probability 0.
    Returns (int32 `[n, K]`, fp16 `[n, K]`)."""
    import torch

    k = ids.shape[-1]
    out_ids = torch.full((n, k), -1, dtype=torch.int32)
    out_logp = torch.zeros((n, k), dtype=torch.float16)
    resp = n - prompt_len
    out_ids[prompt_len:], out_logp[prompt_len:] = ids[:resp], logp[:resp]
    return out_ids, out_logp
