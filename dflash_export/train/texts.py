"""Teacher-forced rows as draft training data: the target reads a text set's rows (text, or token ids)
without generating, and its tap features and top-K next-token distribution at every position become
the data.

One forward reads a whole row, so a row's token costs a prefill's share of a forward (a quarter of a
generated token here). Rows of ids re-read responses a data cache already holds, for other taps. Rows of
text give contexts the target's own answers never reach; past the first block position their labels are
the text's tokens, not the target's own continuation, so `--distill` (the target's distribution at each
position) suits them best (measured: library text lowers held-out tau, docs/training.md)."""

from __future__ import annotations

from dflash_export.train.teacher import DISTILL_TOPK
from runtime.errors import DFlashError

# a text row's first token is context only: anchors start at position 1, so every block has features before it
TEXT_CONTEXT_TOKENS = 1


def check_text_rows(rows: list[dict], model, max_tokens: int) -> None:
    """Refuse, before any is read, an id row holding an id outside the target's vocabulary or longer
    than its context, and a text cut (`max_tokens`) beyond that context.

    Raises:
        DFlashError: naming the row and the fix.
    """
    vocab = int(model.config.vocab_size)
    context = getattr(model.config, "max_position_embeddings", None)
    if context and max_tokens > context and rows and "text" in rows[0]:
        raise DFlashError(f"--max-new-tokens {max_tokens} cuts text rows beyond the target's context of {context} "
                          "tokens; lower it")
    for r in rows:
        ids = r.get("ids") or ()
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise DFlashError(f"text-set row {r['id']!r} holds token id {bad}, outside the target's vocabulary "
                              f"({vocab} ids): were its ids made for another tokenizer?")
        if context and len(ids) > context:
            raise DFlashError(f"text-set row {r['id']!r} is {len(ids)} ids, beyond the target's context of {context} "
                              "tokens: cut or drop it")


def teacher_forced_call(tok, model, rows: list[dict], taps, max_tokens: int, device) -> tuple[list, list, list]:
    """Read `rows` (text-set rows) through the target in one batched forward.

    Each row's text is tokenized raw (no chat template) and cut to `max_tokens` tokens; rows of token
    ids (`"ids"`, with their `"prompt_len"`: e.g. another data cache's sequences, read again for other
    taps) are taken whole. Padding goes on the right, so every real token keeps its position.

    Returns:
        (sequences [{"id", "category", "prompt_len": 1, "ids"}], per row fp16 tap features
        `[n, k*d]`, per row (int32 `[n, K]` ids, fp16 `[n, K]` log-probabilities) where row t is the
        target's distribution of the token at t and row 0 is empty: ids -1, log-probability 0).
    """
    import torch

    enc = _id_rows(rows, tok.pad_token_id, device) if "ids" in rows[0] else _text_rows(tok, rows, max_tokens, device)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True, use_cache=False)
    # hidden_states[L + 1] is the output of decoder layer L
    feats = torch.cat([out.hidden_states[layer + 1] for layer in taps], dim=-1)
    seqs, chunks, dists = [], [], []
    for j, r in enumerate(rows):
        n = int(enc["attention_mask"][j].sum())
        ids = enc["input_ids"][j, :n].tolist()
        seqs.append({"id": r["id"], "category": r["category"], "prompt_len": r.get("prompt_len", TEXT_CONTEXT_TOKENS), "ids": ids})
        chunks.append(feats[j, :n].to(torch.float16).cpu())
        row_ids = torch.full((n, DISTILL_TOPK), -1, dtype=torch.int32)
        row_logp = torch.zeros((n, DISTILL_TOPK), dtype=torch.float16)
        # position t predicts the token at t + 1 (one row's fp32 log-softmax at a time bounds the memory)
        top_logp, top_ids = torch.topk(torch.log_softmax(out.logits[j, : n - 1].float(), dim=-1), DISTILL_TOPK, dim=-1)
        row_ids[1:], row_logp[1:] = top_ids.to(torch.int32).cpu(), top_logp.to(torch.float16).cpu()
        dists.append((row_ids, row_logp))
    return seqs, chunks, dists


def _text_rows(tok, rows: list[dict], max_tokens: int, device) -> dict:
    """Text rows tokenized raw, cut to `max_tokens`, right-padded: {"input_ids", "attention_mask"}."""
    side = tok.padding_side
    tok.padding_side = "right"
    try:
        return tok([r["text"] for r in rows], return_tensors="pt", padding=True, truncation=True,
                   max_length=max_tokens, add_special_tokens=False).to(device)
    finally:
        tok.padding_side = side


def _id_rows(rows: list[dict], pad_id: int, device) -> dict:
    """Rows of token ids right-padded with `pad_id`: {"input_ids", "attention_mask"}."""
    import torch

    width = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for j, r in enumerate(rows):
        ids[j, : len(r["ids"])] = torch.tensor(r["ids"], dtype=torch.int64)
        mask[j, : len(r["ids"])] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
