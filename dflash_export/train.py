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
import shutil
import sys
import tempfile
import time
from pathlib import Path

from runtime.errors import DFlashError

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "models" / "prompts"
# the shipped training prompts: every train*.jsonl (the held-out evaluation set, eval.jsonl, is not one)
DEFAULT_PROMPTS = tuple(sorted(PROMPTS_DIR.glob("train*.jsonl")))


# ---------------------------------------------------------------------------------------------
# data: target-generated responses and their tap features, cached on disk
# ---------------------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[dict]:
    """Read a JSONL prompt file: one {"id", "category", "prompt"} object a line.

    Raises:
        DFlashError: missing file, bad JSON, or a line without "prompt".
    """
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"prompt file {path} does not exist")
    rows = []
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
        row.setdefault("id", f"{path.stem}-line-{i}")  # unique across files too
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
        DFlashError: `cache` holds finished data whose fingerprint differs from `fingerprint`.

    Returns:
        {"sequences": [{"id", "category", "prompt_len", "ids"}], "taps": fp16 tensor [total, k*d],
         "offsets": list of row offsets into taps per sequence, "gen_dtype": "fp32" | "bfloat16" |
         "unknown" (a cache written before the dtype was recorded)}.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    seq_path, taps_path = cache / "sequences.json", cache / "taps.safetensors"
    if seq_path.is_file() and taps_path.is_file():
        seqs = json.loads(seq_path.read_text())
        with safe_open(str(taps_path), "pt") as f:
            meta = f.metadata() or {}
            made_for = meta.get("fingerprint")
            if fingerprint and made_for and made_for != fingerprint:  # (caches before fingerprints: trusted)
                raise DFlashError(f"data cache {cache} was generated with other settings (target, prompts, "
                                  "--max-new-tokens, --taps, sampling or --gen-dtype); pass another --data-cache "
                                  "directory or delete this one")
            return {"sequences": seqs, "taps": f.get_tensor("taps"), "offsets": f.get_tensor("offsets").tolist(),
                    # caches written before the dtype was recorded: unknown
                    "gen_dtype": meta.get("gen_dtype", "unknown")}
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
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            for r in rows
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
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
    bar.close()
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.shape[0])
    taps_t = torch.cat(chunks, dim=0).contiguous()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".data-", dir=cache))
    gen_dtype = _dtype_name(dtype)
    save_file({"taps": taps_t, "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(tmp / "taps.safetensors"),
              metadata={"gen_dtype": gen_dtype, "fingerprint": fingerprint})
    (tmp / "sequences.json").write_text(json.dumps(seqs))
    (tmp / "taps.safetensors").replace(taps_path)
    (tmp / "sequences.json").replace(seq_path)
    shutil.rmtree(tmp, ignore_errors=True)
    for left in cache.glob(".partial-*"):  # also those of interrupted runs with another --gen-batch/dtype
        shutil.rmtree(left, ignore_errors=True)
    return {"sequences": seqs, "taps": taps_t, "offsets": offsets, "gen_dtype": gen_dtype}


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
    """Initialise draft layers from the target's last layers (same shapes); q/k norms stay at one."""
    import torch

    first = tspec.arch.num_layers - layers
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            prefix = f"model.layers.{first + i}."
            for name, p in layer.named_parameters():
                src = tstate.get(prefix + name)
                if src is not None and tuple(src.shape) == tuple(p.shape):
                    p.copy_(src.to(p.dtype))
        if "model.norm.weight" in tstate:
            draft.norm.weight.copy_(tstate["model.norm.weight"])


def _load_init_draft(source: Path, tspec, dspec) -> dict:
    """Load the weights of `--init-from` (a trained draft to fine-tune on more data with a new schedule),
    before any data are generated so a wrong source fails first.

    Returns:
        {"weights": state dict (names without "model."), "sha256": {file name: sha256} of its weights}.

    Raises:
        DFlashError: `source` is not a valid draft checkpoint for this target's shapes, or its layers, taps,
            block size or mask token id differ from this run's options.
    """
    from .checkpoint import file_sha256, load_draft_spec

    spec, state = load_draft_spec(source, tspec)
    ours = (dspec.arch.num_layers, tuple(dspec.target_layer_ids), dspec.block_size, dspec.mask_token_id)
    theirs = (spec.arch.num_layers, tuple(spec.target_layer_ids), spec.block_size, spec.mask_token_id)
    if ours != theirs:
        raise DFlashError(f"--init-from {source}: that draft has (layers, taps, block size, mask id) {theirs} but this "
                          f"run {ours}; pass --layers {theirs[0]} --taps {' '.join(map(str, theirs[1]))} "
                          f"--block-size {theirs[2]} --mask-token-id {theirs[3]}")
    return {"weights": state, "sha256": {f.name: file_sha256(f) for f in sorted(Path(source).glob("*.safetensors"))}}


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
        if getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.block_size < 2:
        raise DFlashError(f"--block-size must be at least 2 (got {args.block_size})")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise DFlashError(f"--max-prompts must be at least 1 (got {args.max_prompts})")
    if not 0.01 <= args.sample_temperature <= 100:  # (NaN fails too) below 0.01 logits / T overflow
        raise DFlashError(f"--sample-temperature must be between 0.01 and 100 (got {args.sample_temperature}); "
                          "the first response per prompt is already the greedy one")
    if not (args.lr > 0 and math.isfinite(args.lr)) or not args.gamma > 0 or not 0 <= args.warmup < 1:
        raise DFlashError("--lr and --gamma must be positive and --warmup in [0, 1)")
    if args.device not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        raise DFlashError(f"--device must be auto, cpu or cuda[:N] (got {args.device!r})")
    if args.resume and not (Path(args.resume) / "train_state" / "state.json").is_file():
        raise DFlashError(f"--resume {args.resume}: no train_state/state.safetensors + state.json there (written every --save-every steps)")


def train_draft(args) -> int:
    """Run `train-draft` (see module docstring). Returns the exit status."""
    import torch
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from .checkpoint import build_target_layer_ids, file_sha256, load_state_dict, load_target_spec, parse_draft_config
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
    taps = tuple(args.taps) if args.taps else tuple(build_target_layer_ids(tspec.arch.num_layers, args.layers))
    mask_id = EMBEDDED_MASK_TOKEN_ID if args.mask_token_id is None else args.mask_token_id
    cfg = _draft_config(tspec, args.layers, taps, args.block_size, mask_id)
    dspec = parse_draft_config(cfg, tspec, "(training)", None)  # validates taps and mask id
    init_state = _load_init_draft(Path(args.init_from), tspec, dspec) if args.init_from else None
    prompt_files = [Path(f) for f in args.prompts]
    prompt_sets = [read_prompts(f)[: args.max_prompts] for f in prompt_files]  # (None: all)
    seen_ids: dict[str, Path] = {}
    for f, rows in zip(prompt_files, prompt_sets):
        for r in rows:
            if str(r["id"]) in seen_ids:
                raise DFlashError(f"prompt id {r['id']!r} appears in {seen_ids[str(r['id'])]} and again in {f}; "
                                  "ids must be unique across --prompts files (they name the cached responses)")
            seen_ids[str(r["id"])] = f
    out = Path(args.out).resolve()
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
    seqs = [s for s in data["sequences"] if len(s["ids"]) - s["prompt_len"] >= 2]
    index = {s["id"]: i for i, s in enumerate(data["sequences"])}
    tstate = load_state_dict(target_dir)
    embed_w = tstate["model.embed_tokens.weight"].float().to(device)
    head_w = (tstate.get("lm_head.weight", tstate["model.embed_tokens.weight"])).float()
    vocab, label_map = None, None
    if args.loss_vocab == "seen":
        vocab, label_map = loss_vocabulary(seqs, head_w.shape[0])
        head_w, label_map = head_w[vocab].contiguous(), label_map.to(device)
    head_w = head_w.to(device)
    amp_dtype = _amp_dtype(args.amp, device)
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
    if args.resume:
        rdir = Path(args.resume)
        state_file, meta_file = rdir / "train_state" / "state.safetensors", rdir / "train_state" / "state.json"
        if not state_file.is_file() or not meta_file.is_file():
            raise DFlashError(f"--resume {rdir}: no train_state/state.safetensors + state.json there (written every --save-every steps)")
        st = load_file(str(state_file))
        draft.load_state_dict({k[len("model.") :]: v for k, v in st.items() if k.startswith("model.")})
        meta = json.loads(meta_file.read_text())
        opt_state = opt.state_dict()
        names = [n for n, _ in draft.named_parameters()]
        for i, n in enumerate(names):
            if f"exp_avg.{n}" in st:
                opt_state["state"][i] = {"step": torch.tensor(float(meta["step"])), "exp_avg": st[f"exp_avg.{n}"], "exp_avg_sq": st[f"exp_avg_sq.{n}"]}
        opt.load_state_dict(opt_state)
        for key, now in (("loss_vocab", args.loss_vocab), ("amp", args.amp)):
            before = meta.get(key, "full" if key == "loss_vocab" else now)  # states before these options: full
            if before != now:
                raise DFlashError(f"--resume {rdir}: that run used --{key.replace('_', '-')} {before}; pass the same to resume it")
        start_step, losses = meta["step"], meta.get("losses", [])
        rng.setstate(tuple(meta["rng"][:1]) + (tuple(meta["rng"][1]),) + tuple(meta["rng"][2:]))

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
        # a subdirectory, so checkpoint loaders that read every *.safetensors at the top level ignore it
        sdir = out / "train_state"
        sdir.mkdir(exist_ok=True)
        save_file(tensors, str(sdir / ".state.tmp"))
        (sdir / ".state.tmp").replace(sdir / "state.safetensors")
        (sdir / "state.json").write_text(json.dumps({"step": step, "losses": losses, "rng": [rs[0], list(rs[1]), rs[2]],
                                                   "loss_vocab": args.loss_vocab, "amp": args.amp}))

    draft.train()
    bar = tqdm(range(start_step, args.steps), desc="training draft", file=sys.stderr, initial=start_step, total=args.steps)
    t_train = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for _ in range(args.batch):
            s = seqs[rng.randrange(len(seqs))]
            i = index[s["id"]]
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
        opt.step()
        losses.append(total / max(count, 1))
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", lr=f"{lr_at(step):.1e}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_state(step + 1)
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


def _write_draft(draft, cfg: dict, out: Path, args, draft_vocab: list[int] | None, record: dict) -> None:
    """Write config.json + model.safetensors + training_record.json (+ draft_vocab.json, the ids the
    loss ran over, from which `build` lets the draft propose) atomically into `out`."""
    import torch
    from safetensors.torch import save_file

    from .checkpoint import DRAFT_VOCAB_FILE

    dtype = torch.float16 if args.save_dtype == "fp16" else torch.float32
    cfg = dict(cfg)
    cfg["torch_dtype"] = "float16" if dtype == torch.float16 else "float32"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "training_record.json").write_text(json.dumps(record, indent=2))
        names = ["config.json", "model.safetensors", "training_record.json"]
        if draft_vocab is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps({"format": "dflash_export.draft_vocab", "token_ids": draft_vocab}))
            names.append(DRAFT_VOCAB_FILE)
        elif (out / DRAFT_VOCAB_FILE).exists():
            (out / DRAFT_VOCAB_FILE).unlink()  # a full-vocabulary run replaces an earlier reduced one
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
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length when generating data")
    p.add_argument("--gen-batch", type=int, default=64,
                   help="prompts per batched generation call (default 64; memory grows with it: every layer's "
                        "hidden states of every step are kept until the call ends)")
    p.add_argument("--gen-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="target dtype while generating data (auto: bf16 where the CPU/GPU has native bf16 matmuls)")
    p.add_argument("--responses-per-prompt", type=int, default=1,
                   help="1 greedy response per prompt, plus K-1 sampled ones (more data from the same prompts)")
    p.add_argument("--sample-temperature", type=float, default=0.8, help="temperature of the sampled responses")
    p.add_argument("--data-cache", nargs="+", default=None, metavar="DIR",
                   help="where generated data are cached, one directory per --prompts file (default: under the cache dir)")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--taps", type=int, nargs="+", default=None, help="target layer ids (default: reference rule)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None, help="default: 16 (SmolLM2 <empty_output>)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--anchors", type=int, default=16, help="anchor blocks per sequence")
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay exp(-(k-1)/gamma)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    p.add_argument("--init", choices=["target", "random"], default="target", help="initialise draft layers from the target's last layers")
    p.add_argument("--loss-vocab", choices=["seen", "full"], default="seen",
                   help="softmax over the token ids seen in the training data (default, much faster) or the full vocabulary")
    p.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto",
                   help="autocast the forward to bf16 (auto: where the CPU/GPU has native bf16 matmuls)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from a trained draft's weights (same layers, taps, block size and mask id) with a fresh schedule")
    p.add_argument("--resume", default=None, help="directory with train_state.* to resume from (usually --out)")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--save-dtype", choices=["fp16", "fp32"], default="fp16")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=train_draft)
