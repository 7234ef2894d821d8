"""`train-draft`: train a DFlash draft for a target that has none.

Recipe (published by third parties; dflash-facts section 7): the target, its embeddings and LM head are
frozen; training data are the target's OWN greedy responses to a prompt set; per sequence, random anchor
positions inside the response each start a block `[anchor token, MASK x (B-1)]` at positions
anchor..anchor+B-1 that attends bidirectionally to itself and to the target's tap features of the
positions strictly before the anchor; the loss is cross-entropy at block position k (1..B-1) predicting
token anchor+k, weighted exp(-(k-1)/gamma); AdamW, cosine schedule with warmup, gradient clipping.

The output directory is a draft in the released DFlash format (`config.json` + `model.safetensors`), which
`build --draft` loads, plus `training_record.json` and the resume state (`train_state/state.safetensors`
with weights and AdamW moments, `train_state/state.json` with step, losses and RNG state; written every
`--save-every` steps and at the end). Nothing is ever pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from runtime.errors import DFlashError

from .checkpoint import share_permissions

# what train-draft writes into --out: an existing --out holding anything else is refused
TRAIN_OUTPUT_FILES = ("config.json", "model.safetensors", "training_record.json", "draft_vocab.json", "train_state")
PROMPTS_DIR = Path(__file__).resolve().parent.parent / "models" / "prompts"
# the shipped training prompts: every train*.jsonl (the held-out evaluation set, eval.jsonl, is not one)
DEFAULT_PROMPTS = tuple(sorted(PROMPTS_DIR.glob("train*.jsonl")))


# ---------------------------------------------------------------------------------------------
# data: target-generated responses and their tap features, cached on disk
# ---------------------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[dict]:
    """Read a JSONL prompt file: one {"id", "category", "prompt"} object a line.

    Raises:
        DFlashError: missing file, bad JSON, a line without "prompt", an "id" that is not a string or
            integer, ends in "#s<N>" (reserved for sampled responses) or is used twice in the file.
    """
    path = Path(path)
    if path.is_dir():
        raise DFlashError(f"prompt file {path} is a directory; pass the JSONL files in it")
    if not path.is_file():
        raise DFlashError(f"prompt file {path} does not exist")
    rows, ids = [], set()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DFlashError(f"prompt file {path} is not UTF-8 text") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashError(f"{path}:{i} is not valid JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise DFlashError(f"{path}:{i} has no non-empty \"prompt\" string")
        row.setdefault("id", f"{path.stem}-line-{i}")  # unique across files too (unless two share a stem)
        if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
            raise DFlashError(f"{path}:{i}: \"id\" must be a string or an integer (got {row['id']!r})")
        if re.search(r"#s\d+$", str(row["id"])):
            raise DFlashError(f"{path}:{i}: prompt id {row['id']!r} ends like a sampled response's id (<id>#s<N>, "
                              "reserved by --responses-per-prompt); rename it")
        if str(row["id"]) in ids:
            raise DFlashError(f"{path}:{i}: prompt id {row['id']!r} is used twice in this file; ids name the cached "
                              "responses, so each must be unique")
        ids.add(str(row["id"]))
        row.setdefault("category", "uncategorized")
        rows.append(row)
    if not rows:
        raise DFlashError(f"{path} holds no prompts")
    return rows


def _load_target(target_dir: Path, device, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=dtype or torch.float32, trust_remote_code=False, use_safetensors=True
    )
    model.eval().to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return tok, model


def generate_dataset(
    target_dir: Path,
    prompts: list[dict],
    taps: tuple[int, ...],
    cache: Path,
    max_new_tokens: int,
    batch: int,
    device,
    show_progress: bool = True,
    responses_per_prompt: int = 1,
    sample_temperature: float = 0.8,
    seed: int = 0,
    dtype=None,
    fingerprint: str = "",
) -> dict:
    """Generate the target's greedy responses and record the tap features of every position.

    With `responses_per_prompt` K > 1, each prompt also gets K - 1 responses sampled at
    `sample_temperature` (seeded; ids `<id>#s<k>`): more target-distribution data from the same prompts,
    which is what a small prompt set limits (the first response stays the greedy one).

    The tap features come from the generation passes themselves (prefill + one step per token), so
    no second forward over the data is needed. `dtype` (default fp32) is the target's weight dtype for
    generation: bf16 runs about 2.4x faster on CPUs with native bf16 matmuls (measured on this project's
    2-core Zen 4, batch 128); its responses are the target's own up to near-tie argmax flips, and its
    features carry bf16 rounding (about 0.4%), which the draft tolerates. Results are cached in `cache/` (`sequences.json`,
    `taps.safetensors`) and reused when present. While generating, each batched call's output is also
    saved (`cache/.partial-*/`), so a run interrupted after hours resumes at the call where it stopped.
    `fingerprint` (the caller's hash of target, prompts and settings) is stored with both and compared
    on reuse: saved calls of other settings are regenerated, a finished cache of other settings is refused.

    Raises:
        DFlashError: `cache` holds finished data whose fingerprint differs from `fingerprint`, or damaged
            data; a prompt plus `max_new_tokens` exceeds the target's context (the prompt's id is named).

    Returns:
        {"sequences": [{"id", "category", "prompt_len", "ids"}], "taps": fp16 tensor [total, k*d],
         "offsets": list of row offsets into taps per sequence, "gen_dtype": "fp32" | "bfloat16" |
         "unknown" (a cache written before the dtype was recorded)}.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    seq_path, taps_path = cache / "sequences.json", cache / "taps.safetensors"
    if seq_path.is_file() and taps_path.is_file():
        return _read_finished_cache(cache, fingerprint)
    tok, model = _load_target(target_dir, device, dtype)
    tok.padding_side = "left"
    if tok.pad_token is None:  # e.g. Llama-3 tokenizers: pad with EOS (masked out anyway)
        tok.pad_token = tok.eos_token
    pad_id = tok.pad_token_id
    seqs, chunks = [], []
    # round 0 is greedy, rounds 1.. are sampled; each generate call stays within one round
    calls = [(rnd, start) for rnd in range(responses_per_prompt) for start in range(0, len(prompts), batch)]
    bar = tqdm(total=len(prompts) * responses_per_prompt, desc="generating target responses",
               disable=not show_progress, file=sys.stderr)
    # each call's output is kept until the whole set is written, so an interrupted run resumes where it
    # stopped (calls are seeded one by one, so the resumed data equal an uninterrupted run's)
    pieces = cache / f".partial-batch{batch}-{_dtype_name(dtype)}"
    try:
        for rnd, start in calls:
            rows = prompts[start : start + batch]
            piece = pieces / f"round{rnd}-start{start}.safetensors"
            done = _read_piece(piece, [r["id"] for r in rows], fingerprint)
            if done is not None:
                seqs.extend(done[0])
                chunks.extend(done[1])
                bar.update(len(rows))
                continue
            first_new = len(seqs)
            sampling = {}
            if rnd > 0:
                torch.manual_seed(seed * 1000003 + rnd * 7919 + start)
                sampling = {"do_sample": True, "temperature": sample_temperature, "top_k": 0, "top_p": 1.0}
            # instruct targets answer one user turn; a base model (no chat template) continues the raw prompt,
            # as bench and generate --chat treat it
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True, enable_thinking=False
                ) if tok.chat_template else r["prompt"]
                for r in rows
            ]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template).to(device)
            context = getattr(model.config, "max_position_embeddings", None)
            for r, n in zip(rows, enc["attention_mask"].sum(dim=1).tolist()):
                if context and n + max_new_tokens > context:
                    raise DFlashError(f"prompt {r['id']!r} is {n} tokens with the chat template; with --max-new-tokens "
                                      f"{max_new_tokens} that exceeds the target's context of {context} tokens: shorten "
                                      "or drop that prompt, or lower --max-new-tokens")
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    **(sampling or {"do_sample": False}),
                    pad_token_id=pad_id,
                    output_hidden_states=True,
                    return_dict_in_generate=True,
                )
            width = enc["input_ids"].shape[1]
            # hidden_states[step][layer]: step 0 = prefill [b, width, d], later steps [b, 1, d]
            per_layer = []
            for layer in taps:
                idx = layer + 1  # HF hidden_states[L + 1] is the output of decoder layer L
                per_layer.append(torch.cat([step[idx] for step in out.hidden_states], dim=1))
            feats = torch.cat(per_layer, dim=-1)  # [b, width + steps, k*d]
            for j, r in enumerate(rows):
                mask = enc["attention_mask"][j].bool()
                prompt_ids = enc["input_ids"][j][mask].tolist()
                gen = out.sequences[j, width:].tolist()
                resp = []
                for t in gen:
                    if t == pad_id and t not in (tok.eos_token_id,):
                        break
                    resp.append(t)
                    if t == tok.eos_token_id:
                        break
                ids = prompt_ids + resp
                # features exist for every fed token: the prompt and all generated tokens but the last
                f = feats[j, width - len(prompt_ids) : width - len(prompt_ids) + len(ids)]
                if f.shape[0] < len(ids):  # the last generated token was never fed
                    f = torch.cat([f, torch.zeros(len(ids) - f.shape[0], f.shape[1], dtype=f.dtype)], dim=0)
                sid = r["id"] if rnd == 0 else f"{r['id']}#s{rnd}"
                seqs.append({"id": sid, "category": r["category"], "prompt_len": len(prompt_ids), "ids": ids})
                chunks.append(f.to(torch.float16).cpu())
            pieces.mkdir(parents=True, exist_ok=True)
            save_file({f"row{j}": c for j, c in enumerate(chunks[first_new:])}, str(pieces / ".piece.tmp"),
                      metadata={"prompt_ids": json.dumps([r["id"] for r in rows]), "sequences": json.dumps(seqs[first_new:]),
                                "fingerprint": fingerprint})
            (pieces / ".piece.tmp").replace(piece)
            bar.update(len(rows))
    except KeyboardInterrupt:
        bar.close()
        kept = len(list(pieces.glob("round*.safetensors"))) if pieces.is_dir() else 0
        print(f"\ndata generation interrupted: {kept} of {len(calls)} generate calls are saved in {pieces}; rerun the "
              "same command (same --gen-batch and --gen-dtype) to continue from there", file=sys.stderr)
        raise
    bar.close()
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.shape[0])
    taps_t = torch.cat(chunks, dim=0).contiguous()
    cache.mkdir(parents=True, exist_ok=True)
    for left in cache.glob(".data-*"):  # a write killed before its cleanup could run (GBs each)
        shutil.rmtree(left, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".data-", dir=cache))
    gen_dtype = _dtype_name(dtype)
    try:
        save_file({"taps": taps_t, "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(tmp / "taps.safetensors"),
                  metadata={"gen_dtype": gen_dtype, "fingerprint": fingerprint})
        (tmp / "sequences.json").write_text(json.dumps(seqs))
        share_permissions(tmp)
        (tmp / "taps.safetensors").replace(taps_path)
        (tmp / "sequences.json").replace(seq_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for left in cache.glob(".partial-*"):  # also those of interrupted runs with another --gen-batch/dtype
        shutil.rmtree(left, ignore_errors=True)
    return {"sequences": seqs, "taps": taps_t, "offsets": offsets, "gen_dtype": gen_dtype}


def _read_finished_cache(cache: Path, fingerprint: str) -> dict:
    """Load a finished data cache (`sequences.json` + `taps.safetensors`), checked against `fingerprint`
    and for internal consistency (one feature row per token of every sequence).

    Raises:
        DFlashError: the cache was made with other settings, or its files are damaged or disagree.
    """
    from safetensors import SafetensorError, safe_open

    damaged = f"; delete {cache} to regenerate it"
    try:
        seqs = json.loads((cache / "sequences.json").read_text())
        with safe_open(str(cache / "taps.safetensors"), "pt") as f:
            meta = f.metadata() or {}
            made_for = meta.get("fingerprint")
            if fingerprint and made_for and made_for != fingerprint:  # (caches before fingerprints: trusted)
                raise DFlashError(f"data cache {cache} was generated with other settings (target, prompts, "
                                  "--max-prompts, --max-new-tokens, --taps, sampling or --gen-dtype); pass another "
                                  "--data-cache directory or delete this one")
            taps, offsets = f.get_tensor("taps"), f.get_tensor("offsets").tolist()
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # (JSONDecodeError is a ValueError)
        raise DFlashError(f"data cache {cache} is damaged ({type(exc).__name__}: {exc}){damaged}") from None
    ok = (isinstance(seqs, list) and len(offsets) == len(seqs) + 1 and offsets[-1] == taps.shape[0]
          and all(isinstance(s, dict) and isinstance(s.get("ids"), list) and offsets[i + 1] - offsets[i] == len(s["ids"])
                  and isinstance(s.get("prompt_len"), int) and 0 <= s["prompt_len"] <= len(s["ids"])
                  and all(type(t) is int and t >= 0 for t in s["ids"]) for i, s in enumerate(seqs)))
    if not ok:
        raise DFlashError(f"data cache {cache}: sequences.json and taps.safetensors disagree (another run's files?){damaged}")
    # caches written before the dtype was recorded: unknown
    return {"sequences": seqs, "taps": taps, "offsets": offsets, "gen_dtype": meta.get("gen_dtype", "unknown")}


def _read_piece(path: Path, prompt_ids: list, fingerprint: str) -> tuple[list[dict], list] | None:
    """One generate call's saved output (sequences, fp16 feature rows), or None if absent, unreadable
    or made for other prompts or settings (then the call runs again)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if json.loads(meta.get("prompt_ids", "null")) != prompt_ids or meta.get("fingerprint", "") != fingerprint:
                return None
            seqs = json.loads(meta["sequences"])
            return seqs, [f.get_tensor(f"row{j}") for j in range(len(seqs))]
    except Exception:  # a torn or foreign file: regenerate (pieces are written whole, so this is rare)
        return None


def merge_datasets(parts: list[dict]) -> dict:
    """Concatenate datasets returned by :func:`generate_dataset` (one per prompt file). The parts'
    `taps` are released as they are copied (set to None).

    Returns the same layout: sequences in order, `taps` fp16 [sum of rows, k*d], `offsets` shifted
    into the joined tensor, and `gen_dtype` the common dtype or "mixed (a, b)" if the caches differ.
    """
    import torch

    if len(parts) == 1:
        return parts[0]
    seqs, offsets, base = [], [0], 0
    taps = torch.empty(sum(part["offsets"][-1] for part in parts), parts[0]["taps"].shape[1], dtype=parts[0]["taps"].dtype)
    for part in parts:
        seqs.extend(part["sequences"])
        offsets.extend(base + o for o in part["offsets"][1:])
        taps[base : base + part["offsets"][-1]] = part["taps"]
        part["taps"] = None  # free each part once copied: peak memory is the data plus one part, not twice the data
        base += part["offsets"][-1]
    dtypes = sorted({part["gen_dtype"] for part in parts})
    return {"sequences": seqs, "taps": taps, "offsets": offsets,
            "gen_dtype": dtypes[0] if len(dtypes) == 1 else f"mixed ({', '.join(dtypes)})"}


# ---------------------------------------------------------------------------------------------
# the training forward: many blocks of one sequence at once
# ---------------------------------------------------------------------------------------------
def blocks_forward(draft, ctx_feats, block_emb, anchors):
    """Draft forward for K blocks of one sequence in one pass (training form of DFlashDraft.forward).

    Args:
        draft: a :class:`dflash_export.modules.DFlashDraft`.
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

    from .modules import rope_cos_sin

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
    label_map=None, amp_dtype=None,
):
    """Weighted block cross-entropy for one sequence (dflash-facts section 7).

    Args:
        head_weight: fp32 `[V', d]` LM-head rows the softmax runs over: the full head (V' = V), or the
            rows of the loss vocabulary (see `loss_vocabulary`), in which case `label_map` (int64 `[V]`,
            full id -> row of `head_weight`, -1 outside) maps the labels.
        amp_dtype: autocast dtype for the forward (torch.bfloat16) or None for plain fp32.

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
    weights = torch.exp(-(offs[1:].float() - 1) / gamma)[None, :] * valid
    return (ce * weights).sum() / weights.sum(), int(valid.sum())


def loss_vocabulary(sequences: list[dict], vocab_size: int):
    """The token ids the training softmax runs over: every id that occurs in the training sequences.

    The draft only ever has to predict the target's own responses, so a softmax over the ids that occur
    in them gives the same gradients for the correct logit at a fraction of the LM-head cost (49152 ->
    6k to 19k rows for SmolLM2, growing with the data; with bf16 autocast 4.1x the positions per second on a
    2-core CPU, `scripts/train_speed.py`). The
    same idea as the reduced draft vocabularies of EAGLE-3 (Li et al., 2025) and FR-Spec (Zhao et al.,
    2025). Decoding still uses the full LM head (proposals are verified anyway).

    Returns:
        (int64 `[V']` sorted ids, int64 `[vocab_size]` map full id -> index in the first, -1 outside).
    """
    import torch

    ids = sorted({t for s in sequences for t in s["ids"]})
    vocab = torch.tensor(ids, dtype=torch.int64)
    label_map = torch.full((vocab_size,), -1, dtype=torch.int64)
    label_map[vocab] = torch.arange(len(ids), dtype=torch.int64)
    return vocab, label_map


def _amp_dtype(choice: str, device):
    """bf16 autocast where the hardware runs bf16 matmuls natively, else None (fp32)."""
    import torch

    if choice == "fp32":
        return None
    if choice == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else None
    return torch.bfloat16 if _cpu_has_native_bf16() else None


def _dtype_name(dtype) -> str:
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


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def _draft_config(tspec, layers, taps, block_size, mask_id) -> dict:
    from .sources import random_draft_config

    cfg = random_draft_config(tspec, num_layers=layers, block_size=block_size, mask_token_id=mask_id)
    cfg["dflash_config"]["target_layer_ids"] = list(taps)
    cfg["dflash_export"] = {"trained": True}
    return cfg


def _init_from_target(draft, tstate, tspec, layers) -> None:
    """Initialise draft layers from the target's last layers (same shapes); q/k norms stay at one.

    A Qwen3.5 hybrid stores its RMSNorm weights zero-centred (it scales by 1 + w, `qwen3_5.RMSNorm`);
    the draft's norms scale by w, so those are copied as 1 + w (copied as stored they would zero
    the draft's output: a flat loss)."""
    import torch

    offset = 1.0 if tspec.hybrid is not None else 0.0
    first = tspec.arch.num_layers - layers
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            prefix = f"model.layers.{first + i}."
            for name, p in layer.named_parameters():
                src = tstate.get(prefix + name)
                if src is not None and tuple(src.shape) == tuple(p.shape):
                    p.copy_(src.to(p.dtype) + (offset if name.endswith("norm.weight") else 0.0))
        if "model.norm.weight" in tstate:
            draft.norm.weight.copy_(tstate["model.norm.weight"] + offset)


def _load_init_draft(source: Path, tspec) -> dict:
    """Load `--init-from` (a trained draft to fine-tune on more data with a new schedule), before any
    data are generated so a wrong source fails first.

    Returns:
        {"weights": state dict (names without "model."), "sha256": {file name: sha256} of its weights,
         "shape": {"layers", "taps", "block_size", "mask_token_id"} of the draft (the run's defaults),
         "config": its config.json, the base of the trained draft's (head layout, MLP width and RoPE may
         differ from a fresh draft's; `auto_map` is dropped, its modeling file is not copied)}.

    Raises:
        DFlashError: `source` is not a valid draft checkpoint for this target (see `load_draft_spec`).
    """
    from .checkpoint import file_sha256
    from .draft_spec import load_draft_spec

    from .checkpoint import read_config

    spec, state = load_draft_spec(source, tspec)
    config = {k: v for k, v in read_config(source).items() if k not in ("auto_map", "torch_dtype", "dflash_export")}
    config["dflash_export"] = {"trained": True}
    shape = {"layers": spec.arch.num_layers, "taps": list(spec.target_layer_ids), "block_size": spec.block_size,
             "mask_token_id": spec.mask_token_id}
    return {"weights": state, "shape": shape, "config": config,
            "sha256": {f.name: file_sha256(f) for f in sorted(Path(source).glob("*.safetensors"))}}


def _check_resume(rdir: Path, meta: dict, settings: dict, args, amp_dtype) -> None:
    """Refuse a `--resume` whose saved run differs from this one in the draft's shape or meaning, loss
    vocabulary or compute dtype, or is already at `--steps` (checked before any data generation).

    Raises:
        DFlashError: naming the option and the saved run's value.
    """
    for key, now in settings.items():
        before = meta.get("settings", {}).get(key, now)  # (states written before settings were stored: weights' shapes only)
        if before != now:
            shown = " ".join(map(str, before)) if isinstance(before, list) else before
            raise DFlashError(f"--resume {rdir}: that run used --{key.replace('_', '-')} {shown} (this one "
                              f"{' '.join(map(str, now)) if isinstance(now, list) else now}); drop the option or pass the same")
    if meta.get("loss_vocab", "full") != args.loss_vocab:  # (states before this option: full)
        raise DFlashError(f"--resume {rdir}: that run used --loss-vocab {meta.get('loss_vocab', 'full')}; pass the same to resume it")
    # the resolved autocast dtype, not the option: "auto" may mean bf16 on one machine and fp32 on another
    before = meta.get("amp_dtype")
    if before is None and meta.get("amp", args.amp) != args.amp:  # (states before the dtype was stored: the option)
        raise DFlashError(f"--resume {rdir}: that run used --amp {meta['amp']}; pass the same to resume it")
    if before is not None and before != _dtype_name(amp_dtype):
        raise DFlashError(f"--resume {rdir}: that run computed in {before}, this one would in {_dtype_name(amp_dtype)} "
                          f"(--amp {args.amp} here); pass --amp {'fp32' if before == 'fp32' else 'bf16'} to resume it")
    if meta["step"] >= args.steps:
        raise DFlashError(f"--resume {rdir}: that run is already at step {meta['step']}; pass --steps above it "
                          "to train longer (the cosine schedule stretches to the new length)")


def _check_train_args(args) -> None:
    """Refuse bad options before the (possibly long) data generation."""
    if args.data_cache and len(args.data_cache) != len(args.prompts):
        files = " ".join(str(f) for f in args.prompts)
        raise DFlashError(f"--data-cache names {len(args.data_cache)} "
                          f"director{'y' if len(args.data_cache) == 1 else 'ies'} for {len(args.prompts)} --prompts "
                          f"files ({files}); give one directory per prompt file, in the same order (or omit it)")
    if args.data_cache and len({Path(d).resolve() for d in args.data_cache}) < len(args.data_cache):
        raise DFlashError("--data-cache names the same directory twice; each --prompts file needs its own")
    if args.init_from and args.resume:
        raise DFlashError("--init-from and --resume exclude each other: --resume continues a run (same schedule), "
                          "--init-from starts a new one from a trained draft's weights")
    for name in ("steps", "batch", "anchors", "layers", "max_new_tokens", "gen_batch", "responses_per_prompt"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.block_size is not None and args.block_size < 2:
        raise DFlashError(f"--block-size must be at least 2 (got {args.block_size})")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise DFlashError(f"--max-prompts must be at least 1 (got {args.max_prompts})")
    if not 0.01 <= args.sample_temperature <= 100:  # (NaN fails too) below 0.01 logits / T overflow
        raise DFlashError(f"--sample-temperature must be between 0.01 and 100 (got {args.sample_temperature}); "
                          "the first response per prompt is already the greedy one")
    if not (args.lr > 0 and math.isfinite(args.lr)) or not args.gamma > 0 or not 0 <= args.warmup < 1:
        raise DFlashError("--lr and --gamma must be positive and --warmup in [0, 1)")
    if args.save_every < 0:
        raise DFlashError(f"--save-every must be 0 (only at the end) or more (got {args.save_every})")
    if args.threads is not None and args.threads < 1:
        raise DFlashError(f"--threads must be at least 1 (got {args.threads}); omit it to use torch's default")
    _check_device(args.device)
    if args.resume and not (Path(args.resume) / "train_state" / "state.safetensors").is_file():
        raise DFlashError(f"--resume {args.resume}: no train_state/state.safetensors there (written every --save-every steps)")
    if args.taps and len(set(args.taps)) < len(args.taps):
        raise DFlashError(f"--taps names a layer twice ({' '.join(map(str, args.taps))}); give distinct target layer ids")
    if len({Path(f).resolve() for f in args.prompts}) < len(args.prompts):
        raise DFlashError("--prompts names the same file twice; give each prompt file once")
    from .build import check_output_dir

    # an earlier train-draft output (or its resume state) may be replaced, never a directory of other files
    check_output_dir(Path(args.out), markers=("training_record.json", "train_state/state.safetensors"),
                     kind="train-draft output, whose files train-draft would overwrite", allowed=TRAIN_OUTPUT_FILES)
    for d in args.data_cache or []:  # probed now: an unusable path must fail before an hour of generation
        d = Path(d)
        if d.exists() and not d.is_dir():
            raise DFlashError(f"--data-cache {d} is a file; pass a directory")
        base = d
        while not base.exists():
            base = base.parent
        try:  # (nothing is left behind: the directory itself is only created when data are written)
            Path(tempfile.mkdtemp(prefix=".probe-", dir=base)).rmdir()
        except OSError as exc:
            raise DFlashError(f"--data-cache {d}: cannot create directories under {base} ({exc.strerror or exc}); "
                              "pass another directory") from None


def _check_device(device: str) -> None:
    """Refuse a `--device` torch cannot use here, naming the devices that exist.

    Raises:
        DFlashError: not auto/cpu/cuda[:N], CUDA requested without a CUDA build or GPU, or no GPU N.
    """
    if device in ("auto", "cpu"):
        return
    index = device[len("cuda:"):] if device.startswith("cuda:") else ("" if device == "cuda" else None)
    if index is None or (index and not index.isdigit()):
        raise DFlashError(f"--device must be auto, cpu or cuda[:N] (got {device!r})")
    import torch

    if not torch.cuda.is_available():
        raise DFlashError(f"--device {device}: this torch build sees no CUDA GPU; use --device cpu (or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise DFlashError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s), cuda:0.."
                          f"cuda:{torch.cuda.device_count() - 1}")


def train_draft(args) -> int:
    """Run `train-draft` (see module docstring). Returns the exit status."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .checkpoint import file_sha256, load_state_dict, load_target_spec
    from .draft_spec import build_target_layer_ids, parse_draft_config
    from .modules import DFlashDraft, load_weights
    from .sources import EMBEDDED_MASK_TOKEN_ID, cache_dir, resolve_target

    t_start = time.time()
    _check_train_args(args)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, _ = resolve_target(args.target)
    tspec = load_target_spec(target_dir)
    n_target = tspec.arch.num_layers
    out = Path(args.out).resolve()
    if not args.resume and (out / "train_state" / "state.safetensors").is_file():
        raise DFlashError(f"{out} holds a train-draft state (an earlier run's); pass --resume {args.out}"
                          f"{' instead of --init-from' if args.init_from else ''} to continue it, or delete it (or choose "
                          "another --out) to start over")
    # a run that continues (--resume) or fine-tunes (--init-from) takes the draft's shape from its source
    # unless told otherwise; a contradiction is refused below
    resumed = _read_resume_state(Path(args.resume)) if args.resume else None
    init_state = _load_init_draft(Path(args.init_from), tspec) if args.init_from else None
    source = (resumed[1].get("settings") if resumed else None) or (init_state["shape"] if init_state else {})
    for key, default in (("layers", 2), ("taps", None), ("block_size", 16), ("mask_token_id", EMBEDDED_MASK_TOKEN_ID)):
        if getattr(args, key) is None:
            setattr(args, key, source.get(key, default))
    if not any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise DFlashError(f"target {target_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                          "train-draft needs the target's tokenizer to generate its data: copy them into that directory")
    if args.layers > n_target:
        raise DFlashError(f"--layers {args.layers} exceeds the target's {n_target} layers; a draft is a few layers (2-5)")
    if args.taps and not all(0 <= t < n_target for t in args.taps):
        raise DFlashError(f"--taps {' '.join(map(str, args.taps))}: the target has layers 0..{n_target - 1}")
    taps = tuple(args.taps) if args.taps else tuple(build_target_layer_ids(n_target, args.layers))
    if len(set(taps)) < len(taps):
        raise DFlashError(f"the default taps for {args.layers} draft layers over {n_target} target layers repeat a layer "
                          f"{list(taps)}; pass distinct --taps (one per draft layer) or fewer --layers")
    mask_id = args.mask_token_id  # (filled above: given, the source's, or the embedded target's)
    cfg = _draft_config(tspec, args.layers, taps, args.block_size, mask_id)
    dspec = parse_draft_config(cfg, tspec, "(training)", None)  # validates taps and mask id
    # (a source's own config keeps what a fresh one would change: head layout, MLP width, RoPE)
    source_cfg = init_state["config"] if init_state else (resumed[1].get("config") if resumed else None)
    # what a resumed run must share with the run it continues: the draft's shape and meaning (--steps may
    # grow, and --lr may drop after a divergence)
    settings = {"layers": args.layers, "taps": list(taps), "block_size": args.block_size, "mask_token_id": mask_id}
    if init_state is not None and init_state["shape"] != settings:
        theirs = init_state["shape"]
        raise DFlashError(f"--init-from {args.init_from}: that draft has --layers {theirs['layers']} --taps "
                          f"{' '.join(map(str, theirs['taps']))} --block-size {theirs['block_size']} --mask-token-id "
                          f"{theirs['mask_token_id']}, this run --layers {args.layers} --taps {' '.join(map(str, taps))} "
                          f"--block-size {args.block_size} --mask-token-id {mask_id}; drop those options to use the draft's")
    amp_dtype = _amp_dtype(args.amp, device)
    if resumed is not None:
        _check_resume(Path(args.resume), resumed[1], settings, args, amp_dtype)
    if source_cfg is not None:  # same shape settings (checked above): its config is this run's
        cfg = source_cfg
        dspec = parse_draft_config(cfg, tspec, "(training)", None)
    prompt_files = [Path(f) for f in args.prompts]
    prompt_sets = [read_prompts(f)[: args.max_prompts] for f in prompt_files]  # (None: all)
    seen_ids: dict[str, Path] = {}
    for f, rows in zip(prompt_files, prompt_sets):
        for r in rows:
            if str(r["id"]) in seen_ids:
                why = ("; lines without an \"id\" get <file stem>-line-N, so give the files different names or add ids"
                       if str(r["id"]).startswith(f"{f.stem}-line-") else "")
                raise DFlashError(f"prompt id {r['id']!r} appears in {seen_ids[str(r['id'])]} and again in {f}; "
                                  f"ids must be unique across --prompts files (they name the cached responses){why}")
            seen_ids[str(r["id"])] = f
    gen_dtype = _amp_dtype(args.gen_dtype, device)
    # hashed once: for cache keys and the record (a multi-GB target takes a while)
    target_sha = {f.name: file_sha256(f) for f in sorted(Path(target_dir).glob("*.safetensors"))}
    prompts_sha = [file_sha256(f) for f in prompt_files]
    t0 = time.time()
    parts = []
    for i, f in enumerate(prompt_files):
        # one cache per prompt file, so adding a file later reuses the data of the others
        key = hashlib.sha256(
            json.dumps(
                list(target_sha.values()) + [prompts_sha[i], args.max_prompts, args.max_new_tokens, list(taps)]
                # (only when used, so caches of greedy-only fp32 data keep their key)
                + ([args.responses_per_prompt, args.sample_temperature, args.seed] if args.responses_per_prompt > 1 else [])
                + (["bf16"] if gen_dtype is not None else [])
            ).encode()
        ).hexdigest()[:16]
        data_dir = Path(args.data_cache[i]) if args.data_cache else cache_dir() / "train-data" / key
        parts.append(generate_dataset(target_dir, prompt_sets[i], taps, data_dir, args.max_new_tokens, args.gen_batch,
                                      device, responses_per_prompt=args.responses_per_prompt,
                                      sample_temperature=args.sample_temperature, seed=args.seed, dtype=gen_dtype,
                                      fingerprint=key))
    data = merge_datasets(parts)
    del parts
    gen_seconds = time.time() - t0
    top = max((max(s["ids"]) for s in data["sequences"] if s["ids"]), default=0)
    if top >= tspec.vocab_size:
        raise DFlashError(f"the training data hold token id {top}, outside the target's vocabulary ({tspec.vocab_size}): "
                          "a --data-cache of another target or damaged; delete it to regenerate")
    # (by position: a sampled response's id "<id>#s<k>" may equal a user's prompt id)
    usable = [i for i, s in enumerate(data["sequences"]) if len(s["ids"]) - s["prompt_len"] >= 2]
    seqs = [data["sequences"][i] for i in usable]
    if not seqs:
        raise DFlashError(f"no training data: every response is shorter than 2 tokens (--max-new-tokens "
                          f"{args.max_new_tokens}); raise --max-new-tokens or use other prompts")
    tstate = load_state_dict(target_dir)
    if tspec.hybrid is not None:  # a Qwen3_5ForConditionalGeneration's text weights under the CausalLM names
        from .qwen3_5 import text_state_dict

        tstate = text_state_dict(tstate)
    embed_w = tstate["model.embed_tokens.weight"].float().to(device)
    head_w = (tstate.get("lm_head.weight", tstate["model.embed_tokens.weight"])).float()
    vocab, label_map = None, None
    if args.loss_vocab == "seen":
        vocab, label_map = loss_vocabulary(seqs, head_w.shape[0])
        head_w, label_map = head_w[vocab].contiguous(), label_map.to(device)
    head_w = head_w.to(device)
    embed = torch.nn.Embedding.from_pretrained(embed_w, freeze=True)
    draft = DFlashDraft(dspec).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if init_state is not None:
        load_weights(draft, init_state["weights"], f"--init-from {args.init_from}")
    elif args.init == "target":
        _init_from_target(draft, tstate, tspec, args.layers)
    del tstate
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, int(args.warmup * args.steps))

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * 0.5 * (1 + math.cos(math.pi * progress))

    start_step, losses = 0, []
    if resumed is not None:
        rdir = Path(args.resume)
        st, meta = resumed
        weights = {k[len("model.") :]: v for k, v in st.items() if k.startswith("model.")}
        own = draft.state_dict()
        if set(weights) != set(own) or any(tuple(weights[k].shape) != tuple(own[k].shape) for k in own):
            raise DFlashError(f"--resume {rdir}: its weights do not fit a draft with --layers {args.layers} --taps "
                              f"{' '.join(map(str, taps))} --block-size {args.block_size}; pass that run's options")
        draft.load_state_dict(weights)
        opt_state = opt.state_dict()
        names = [n for n, _ in draft.named_parameters()]
        for i, n in enumerate(names):
            if f"exp_avg.{n}" in st:
                opt_state["state"][i] = {"step": torch.tensor(float(meta["step"])), "exp_avg": st[f"exp_avg.{n}"], "exp_avg_sq": st[f"exp_avg_sq.{n}"]}
        opt.load_state_dict(opt_state)
        start_step, losses = meta["step"], meta.get("losses", [])
        rng.setstate(tuple(meta["rng"][:1]) + (tuple(meta["rng"][1]),) + tuple(meta["rng"][2:]))
        del resumed, st, weights

    def save_state(step):
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
        names = [n for n, _ in draft.named_parameters()]
        for i, n in enumerate(names):
            s = opt.state.get(list(draft.parameters())[i])
            if s:
                tensors[f"exp_avg.{n}"] = s["exp_avg"].cpu().contiguous()
                tensors[f"exp_avg_sq.{n}"] = s["exp_avg_sq"].cpu().contiguous()
        rs = rng.getstate()
        meta = json.dumps({"step": step, "losses": losses, "rng": [rs[0], list(rs[1]), rs[2]], "loss_vocab": args.loss_vocab,
                           "amp": args.amp, "amp_dtype": _dtype_name(amp_dtype), "settings": settings,
                           "config": cfg})
        # a subdirectory, so checkpoint loaders that read every *.safetensors at the top level ignore it
        sdir = out / "train_state"
        sdir.mkdir(exist_ok=True)
        # one file, replaced whole, holds weights, moments and step: a kill at any point leaves a consistent state
        # (state.json is a readable copy only)
        try:
            save_file(tensors, str(sdir / ".state.tmp"), metadata={"dflash_export.train_state": meta})
            share_permissions(sdir / ".state.tmp")
            (sdir / ".state.tmp").replace(sdir / "state.safetensors")
            (sdir / ".state.json.tmp").write_text(meta)
            share_permissions(sdir / ".state.json.tmp")
            (sdir / ".state.json.tmp").replace(sdir / "state.json")
        finally:
            for tmp in (sdir / ".state.tmp", sdir / ".state.json.tmp"):
                tmp.unlink(missing_ok=True)

    draft.train()
    bar = tqdm(range(start_step, args.steps), desc="training draft", file=sys.stderr, initial=start_step, total=args.steps)
    t_train = time.time()
    # Ctrl-C stops at the next step boundary, where the state is consistent and is saved; a second one stops at once
    stop_requested = []

    def on_sigint(signum, frame):
        if stop_requested:
            raise KeyboardInterrupt
        stop_requested.append(signum)

    old_handler = signal.signal(signal.SIGINT, on_sigint) if threading.current_thread() is threading.main_thread() else None
    updating = False
    try:
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            total, count = 0.0, 0
            for _ in range(args.batch):
                pick = rng.randrange(len(seqs))
                s, i = seqs[pick], usable[pick]
                lo, hi = data["offsets"][i], data["offsets"][i + 1]
                feats = data["taps"][lo:hi].float().to(device)
                loss, n = block_loss(
                    draft, head_w, embed, s["ids"], feats, s["prompt_len"], args.anchors, args.block_size, mask_id, args.gamma, rng, device,
                    label_map=label_map, amp_dtype=amp_dtype,
                )
                if loss is None:
                    continue
                (loss / args.batch).backward()
                total += float(loss.detach())
                count += 1
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            updating = True
            if math.isfinite(total):  # (a non-finite loss skips the update: the weights stay as they were)
                opt.step()
            losses.append(total / max(count, 1))
            updating = False
            # a non-finite loss, or weights beyond fp16's range (a huge --lr blows them up while the loss is
            # still finite), mean the run diverged: stop rather than write or save a broken draft
            # (measured 1.7 ms for the 7.7M-parameter draft on this CPU: 0.1% of a training step)
            peak = max(float(p.detach().abs().max()) for p in draft.parameters())
            if not math.isfinite(total) or not peak < 65504:
                raise DFlashError(f"training diverged at step {step + 1} (loss {total:.4g}, largest weight {peak:.3g}); "
                                  f"lower --lr (now {args.lr}) and train again")
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", lr=f"{lr_at(step):.1e}")
            if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                save_state(step + 1)
            if stop_requested:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        bar.close()
        # (not mid-update: a half-applied AdamW step is no state to resume from)
        if len(losses) > start_step and not updating:
            save_state(len(losses))
            print(f"\ntraining interrupted after step {len(losses)}; its state is saved: rerun the same command with "
                  f"--resume {args.out}{' instead of --init-from' if args.init_from else ''} to continue", file=sys.stderr)
        else:
            print(f"\ntraining interrupted during an update; the last saved state (if any) is in {out / 'train_state'}",
                  file=sys.stderr)
        raise
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
    bar.close()
    train_seconds = time.time() - t_train
    save_state(args.steps)  # lets `--resume OUT --steps MORE` continue training later
    _write_draft(draft, cfg, out, args, None if vocab is None else vocab.tolist(), {
        "command": " ".join(["python -m dflash_export"] + sys.argv[1:]) if sys.argv else None,
        "target": str(target_dir),
        "target_files_sha256": target_sha,
        "prompts": [str(f) for f in prompt_files],
        "prompts_sha256": prompts_sha,
        "max_prompts_per_file": args.max_prompts,
        "num_sequences": len(seqs),
        "response_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in seqs),
        "max_new_tokens": args.max_new_tokens,
        "responses_per_prompt": args.responses_per_prompt,
        "sample_temperature": args.sample_temperature if args.responses_per_prompt > 1 else None,
        "gen_dtype": data["gen_dtype"],  # from the data themselves (a reused --data-cache may differ)
        "steps": args.steps,
        "resumed_from_step": start_step if args.resume else None,
        "batch": args.batch,
        "anchors_per_sequence": args.anchors,
        "block_size": args.block_size,
        "gamma": args.gamma,
        "lr": args.lr,
        "warmup_fraction": args.warmup,
        "init": f"draft {args.init_from}" if args.init_from else args.init,
        # (the source draft may later be replaced, so its weights are identified by their hash)
        "init_from_sha256": init_state["sha256"] if init_state else None,
        "loss_vocab": args.loss_vocab,
        "loss_vocab_size": int(head_w.shape[0]),
        "amp": _dtype_name(amp_dtype),
        "layers": args.layers,
        "target_layer_ids": list(taps),
        "mask_token_id": mask_id,
        "seed": args.seed,
        "device": str(device),
        "data_generation_seconds": round(gen_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "loss_curve": [round(sum(losses[i : i + 50]) / len(losses[i : i + 50]), 4) for i in range(0, len(losses), 50)],
    })
    print(f"wrote draft {out} (final loss {sum(losses[-50:]) / max(1, len(losses[-50:])):.3f})")
    return 0


def _read_resume_state(rdir: Path) -> tuple[dict, dict]:
    """Read `rdir/train_state/state.safetensors` (weights, AdamW moments and, since the state is one
    file, the step metadata; older states keep that in `state.json` beside it).

    Returns:
        (tensors, metadata dict with "step", "losses", "rng", ...).

    Raises:
        DFlashError: the state is missing, unreadable or torn.
    """
    from safetensors import SafetensorError, safe_open

    state_file = rdir / "train_state" / "state.safetensors"
    try:
        with safe_open(str(state_file), "pt") as f:
            raw = (f.metadata() or {}).get("dflash_export.train_state")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(raw if raw is not None else (rdir / "train_state" / "state.json").read_text())
        meta["step"], meta["rng"]  # noqa: B018 (present in every state this project writes)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise DFlashError(f"--resume {rdir}: its train_state is unreadable ({type(exc).__name__}: {exc}); "
                          "start over without --resume") from None
    return tensors, meta


def _write_draft(draft, cfg: dict, out: Path, args, draft_vocab: list[int] | None, record: dict) -> None:
    """Write config.json + model.safetensors + training_record.json (+ draft_vocab.json, the ids the
    loss ran over, from which `build` lets the draft propose) atomically into `out`."""
    import torch
    from safetensors.torch import save_file

    from .draft_spec import DRAFT_VOCAB_FILE

    dtype = torch.float16 if args.save_dtype == "fp16" else torch.float32
    cfg = dict(cfg)
    cfg["torch_dtype"] = "float16" if dtype == torch.float16 else "float32"
    out.parent.mkdir(parents=True, exist_ok=True)
    for left in out.parent.glob(f".{out.name}.tmp-*"):  # of a run killed (SIGKILL) while writing
        shutil.rmtree(left, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.state_dict().items()}
        bad = [k for k, v in state.items() if not bool(v.isfinite().all())]
        if bad:  # e.g. weights blown up to ~1e30 by a huge --lr: finite in fp32, inf in fp16
            raise DFlashError(f"the trained weights {bad[:3]}{' ...' if len(bad) > 3 else ''} are not finite in "
                              f"{args.save_dtype}: the run diverged; lower --lr (now {args.lr}) and train again")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "training_record.json").write_text(json.dumps(record, indent=2))
        names = ["config.json", "model.safetensors", "training_record.json"]
        if draft_vocab is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps({"format": "dflash_export.draft_vocab", "token_ids": draft_vocab}))
            names.append(DRAFT_VOCAB_FILE)
        elif (out / DRAFT_VOCAB_FILE).exists():
            (out / DRAFT_VOCAB_FILE).unlink()  # a full-vocabulary run replaces an earlier reduced one
        share_permissions(tmp)
        for name in names:
            out.mkdir(parents=True, exist_ok=True)
            (tmp / name).replace(out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def register(sub) -> None:
    """Add the `train-draft` subcommand."""
    p = sub.add_parser("train-draft", help="train a DFlash draft for a target (frozen target, self-generated data)")
    p.add_argument("--target", help="target directory or known name (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output draft directory (released DFlash format)")
    p.add_argument("--prompts", nargs="+", default=[str(d) for d in DEFAULT_PROMPTS], metavar="FILE",
                   help="JSONL prompt files (default: models/prompts/train*.jsonl); each file's data are cached on "
                        "their own, so adding a file reuses the others' data")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length when generating data (default %(default)s)")
    p.add_argument("--gen-batch", type=int, default=64,
                   help="prompts per batched generation call (default 64; memory grows with it: every layer's "
                        "hidden states of every step are kept until the call ends)")
    p.add_argument("--gen-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="target dtype while generating data (auto: bf16 where the CPU/GPU has native bf16 matmuls)")
    p.add_argument("--responses-per-prompt", type=int, default=1,
                   help="1 greedy response per prompt, plus K-1 sampled ones (more data from the same prompts; default %(default)s)")
    p.add_argument("--sample-temperature", type=float, default=0.8, help="temperature of the sampled responses (default %(default)s)")
    p.add_argument("--data-cache", nargs="+", default=None, metavar="DIR",
                   help="where generated data are cached, one directory per --prompts file (default: under the cache dir)")
    # (None: from --init-from's draft or the --resume state, else the default named in the help)
    p.add_argument("--layers", type=int, default=None, help="draft decoder layers (default 2, or the --init-from/--resume source's)")
    p.add_argument("--taps", type=int, nargs="+", default=None, help="target layer ids (default: reference rule)")
    p.add_argument("--block-size", type=int, default=None, help="default 16, or the --init-from/--resume source's")
    p.add_argument("--mask-token-id", type=int, default=None, help="default 16 (SmolLM2 <empty_output>), or the --init-from/--resume source's")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per optimizer step (default %(default)s)")
    p.add_argument("--anchors", type=int, default=16, help="anchor blocks per sequence (default %(default)s)")
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay exp(-(k-1)/gamma) (default %(default)s)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default %(default)s)")
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps (default %(default)s)")
    p.add_argument("--init", choices=["target", "random"], default="target", help="initialise draft layers from the target's last layers, or randomly (default %(default)s)")
    p.add_argument("--loss-vocab", choices=["seen", "full"], default="seen",
                   help="softmax over the token ids seen in the training data (default, much faster) or the full vocabulary")
    p.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto",
                   help="autocast the forward to bf16 (auto: where the CPU/GPU has native bf16 matmuls)")
    p.add_argument("--seed", type=int, default=0, help="seed of anchors, sampling and init (default %(default)s)")
    p.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from a trained draft's weights with a fresh schedule; its layers, taps, block size and mask id are the defaults")
    p.add_argument("--resume", default=None, help="a run's --out whose train_state/ to continue (usually --out itself)")
    p.add_argument("--save-every", type=int, default=200, help="save the resume state every N steps (default %(default)s)")
    p.add_argument("--save-dtype", choices=["fp16", "fp32"], default="fp16", help="dtype of the saved draft weights (default %(default)s)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=train_draft)
