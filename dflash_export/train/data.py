"""The data of `train-draft`: the target's own responses to a prompt set and the tap features of every
position, generated in batched calls and cached on disk per prompt file (a cache is keyed by a hash of
target, prompts and generation settings, and an interrupted generation resumes at the call where it
stopped); `prepare_training_data` turns the command's options into the sequences training samples from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_export.checkpoint.sources import cache_dir
from dflash_export.checkpoint.target import file_sha256, share_permissions
from dflash_export.train.loss import autocast_dtype, dtype_name
from dflash_export.train.prompts import is_text_set, read_prompt_sets
from dflash_export.train.teacher import DISTILL_TOPK, TopKRecorder, rows_of_distribution
from dflash_export.train.texts import check_text_rows, teacher_forced_call
from runtime.errors import DFlashError

def _load_target(target_dir: Path, device, dtype=None):
    """The target's tokenizer (left-padded, for batched generation) and frozen model on `device`."""
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
    tok.padding_side = "left"
    if tok.pad_token is None:  # e.g. Llama-3 tokenizers: pad with EOS (masked out anyway)
        tok.pad_token = tok.eos_token
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
    """Generate the target's greedy responses and record the tap features of every position (for a text
    set, :func:`is_text_set`: read each row's text teacher-forced, cut to `max_new_tokens` tokens).

    With `responses_per_prompt` K > 1, each prompt also gets K - 1 responses sampled at
    `sample_temperature` (seeded; ids `<id>#s<k>`): more target-distribution data from the same prompts,
    which is what a small prompt set limits (the first response stays the greedy one).

    The tap features come from the generation passes themselves (prefill + one step per token), so no
    second forward over the data is needed. `dtype` (default fp32) is the target's weight dtype for
    generation: bf16 runs much faster on CPUs with native bf16 matmuls (figures:
    docs/training.md#speed-the-seen-token-softmax-and-bf16); its responses are the target's own up to
    near-tie argmax flips, and its features carry bf16 rounding (about 0.4%), which the draft tolerates.
    Results are cached in `cache/` (`sequences.json`, `taps.safetensors`) and reused when present. While
    generating, each batched call's output is also saved (`cache/.partial-*/`), so a run interrupted
    after hours resumes at the call where it stopped. `fingerprint` (the caller's hash of target,
    prompts and settings) is stored with both and compared on reuse: saved calls of other settings are
    regenerated, a finished cache of other settings is refused.

    Raises:
        DFlashError: `cache` holds finished data whose fingerprint differs from `fingerprint`, or damaged
            data; a prompt plus `max_new_tokens` exceeds the target's context (the prompt's id is named).

    Returns:
        {"sequences": [{"id", "category", "prompt_len", "ids"}], "taps": fp16 tensor [total, k*d],
         "offsets": list of row offsets into taps per sequence, "gen_dtype": "fp32" | "bfloat16" |
         "unknown" (a cache written before the dtype was recorded)}.
    """
    import torch
    from tqdm import tqdm

    if (cache / "sequences.json").is_file() and (cache / "taps.safetensors").is_file():
        return _read_finished_cache(cache, fingerprint)
    tok, model = _load_target(target_dir, device, dtype)
    text = is_text_set(prompts)  # text rows are read once, teacher-forced: no sampled rounds
    if text:
        check_text_rows(prompts, model, max_new_tokens)
    seqs, chunks, dists = [], [], []
    # round 0 is greedy, rounds 1.. are sampled; each generate call stays within one round
    rounds = 1 if text else responses_per_prompt
    calls = [(rnd, start) for rnd in range(rounds) for start in range(0, len(prompts), batch)]
    bar = tqdm(total=len(prompts) * rounds, desc="reading text" if text else "generating target responses",
               disable=not show_progress, file=sys.stderr)
    # each call's output is kept until the whole set is written, so an interrupted run resumes where it
    # stopped (calls are seeded one by one, so the resumed data equal an uninterrupted run's)
    pieces = cache / f".partial-batch{batch}-{dtype_name(dtype)}"
    try:
        for rnd, start in calls:
            rows = prompts[start : start + batch]
            piece = pieces / f"round{rnd}-start{start}.safetensors"
            done = _read_piece(piece, [r["id"] for r in rows], fingerprint)
            if done is None:
                sampling = {}
                if rnd > 0:
                    torch.manual_seed(seed * 1000003 + rnd * 7919 + start)
                    sampling = {"do_sample": True, "temperature": sample_temperature, "top_k": 0, "top_p": 1.0}
                done = (teacher_forced_call(tok, model, rows, taps, max_new_tokens, device) if text
                        else _generate_call(tok, model, rows, rnd, taps, max_new_tokens, device, sampling))
                _save_piece(piece, rows, *done, fingerprint)
            seqs.extend(done[0])
            chunks.extend(done[1])
            dists.extend(done[2])
            bar.update(len(rows))
    except KeyboardInterrupt:
        bar.close()
        kept = len(list(pieces.glob("round*.safetensors"))) if pieces.is_dir() else 0
        print(f"\ndata generation interrupted: {kept} of {len(calls)} generate calls are saved in {pieces}; rerun the "
              "same command (same --gen-batch and --gen-dtype) to continue from there", file=sys.stderr)
        raise
    bar.close()
    written = _write_finished_cache(cache, seqs, chunks, dists, dtype_name(dtype), fingerprint)
    return {"sequences": seqs, **written, "gen_dtype": dtype_name(dtype)}


def _generate_call(tok, model, rows: list[dict], rnd: int, taps, max_new_tokens: int, device,
                   sampling: dict) -> tuple[list[dict], list]:
    """One batched generate call over `rows` in round `rnd` (0: greedy; later: `sampling`, seeded by the
    caller): its sequences and, per sequence, its fp16 tap-feature rows (one per token)."""
    import torch

    # instruct targets answer one user turn; a base model (no chat template) continues the raw prompt,
    # as bench and generate --chat treat it
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        ) if tok.chat_template else r["prompt"]
        for r in rows
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template).to(device)
    _check_context(model, rows, enc, max_new_tokens)
    recorder = TopKRecorder(DISTILL_TOPK)
    hook = model.get_output_embeddings().register_forward_hook(recorder.hook)
    try:
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                **(sampling or {"do_sample": False}),
                pad_token_id=tok.pad_token_id,
                output_hidden_states=True,
                return_dict_in_generate=True,
            )
    finally:
        hook.remove()
    top_ids, top_logp = recorder.stacked()  # [b, steps, K]
    width = enc["input_ids"].shape[1]
    # hidden_states[step][layer]: step 0 = prefill [b, width, d], later steps [b, 1, d]
    per_layer = []
    for layer in taps:
        idx = layer + 1  # HF hidden_states[L + 1] is the output of decoder layer L
        per_layer.append(torch.cat([step[idx] for step in out.hidden_states], dim=1))
    feats = torch.cat(per_layer, dim=-1)  # [b, width + steps, k*d]
    seqs, chunks, dists = [], [], []
    for j, r in enumerate(rows):
        mask = enc["attention_mask"][j].bool()
        prompt_ids = enc["input_ids"][j][mask].tolist()
        ids = prompt_ids + _response_ids(out.sequences[j, width:].tolist(), tok.pad_token_id, tok.eos_token_id)
        # features exist for every fed token: the prompt and all generated tokens but the last
        f = feats[j, width - len(prompt_ids) : width - len(prompt_ids) + len(ids)]
        if f.shape[0] < len(ids):  # the last generated token was never fed
            f = torch.cat([f, torch.zeros(len(ids) - f.shape[0], f.shape[1], dtype=f.dtype)], dim=0)
        sid = r["id"] if rnd == 0 else f"{r['id']}#s{rnd}"
        seqs.append({"id": sid, "category": r["category"], "prompt_len": len(prompt_ids), "ids": ids})
        chunks.append(f.to(torch.float16).cpu())
        dists.append(rows_of_distribution(top_ids[j], top_logp[j], len(prompt_ids), len(ids)))
    return seqs, chunks, dists


def _check_context(model, rows: list[dict], enc, max_new_tokens: int) -> None:
    """Refuse a prompt whose tokens plus `max_new_tokens` exceed the target's context, naming it."""
    context = getattr(model.config, "max_position_embeddings", None)
    for r, n in zip(rows, enc["attention_mask"].sum(dim=1).tolist()):
        if context and n + max_new_tokens > context:
            raise DFlashError(f"prompt {r['id']!r} is {n} tokens with the chat template; with --max-new-tokens "
                              f"{max_new_tokens} that exceeds the target's context of {context} tokens: shorten "
                              "or drop that prompt, or lower --max-new-tokens")


def _response_ids(generated: list[int], pad_id, eos_id) -> list[int]:
    """A generated row up to and including its EOS; padding after an early stop is cut."""
    resp = []
    for t in generated:
        if t == pad_id and t not in (eos_id,):
            break
        resp.append(t)
        if t == eos_id:
            break
    return resp


def _save_piece(piece: Path, rows: list[dict], seqs: list[dict], chunks: list, dists: list, fingerprint: str) -> None:
    """Keep one generate call's output (replaced whole, so a kill leaves no torn piece)."""
    from safetensors.torch import save_file

    piece.parent.mkdir(parents=True, exist_ok=True)
    tmp = piece.parent / ".piece.tmp"
    tensors = {f"row{j}": c for j, c in enumerate(chunks)}
    for j, (ids, logp) in enumerate(dists):
        tensors[f"topk_ids{j}"], tensors[f"topk_logprobs{j}"] = ids, logp
    save_file(tensors, str(tmp),
              metadata={"prompt_ids": json.dumps([r["id"] for r in rows]), "sequences": json.dumps(seqs),
                        "fingerprint": fingerprint})
    tmp.replace(piece)


def _write_finished_cache(cache: Path, seqs: list[dict], chunks: list, dists: list, gen_dtype: str, fingerprint: str):
    """Write the whole data set into `cache` (both files moved in from a temporary directory) and drop
    the saved calls. Returns {"taps": fp16 [total, k*d], "offsets": row offsets per sequence,
    "topk_ids": int32 [total, K], "topk_logprobs": fp16 [total, K]}."""
    import torch
    from safetensors.torch import save_file

    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.shape[0])
    taps_t = torch.cat(chunks, dim=0).contiguous()
    top_ids = torch.cat([i for i, _ in dists], dim=0).contiguous()
    top_logp = torch.cat([v for _, v in dists], dim=0).contiguous()
    cache.mkdir(parents=True, exist_ok=True)
    for left in cache.glob(".data-*"):  # a write killed before its cleanup could run (GBs each)
        shutil.rmtree(left, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".data-", dir=cache))
    try:
        save_file({"taps": taps_t, "offsets": torch.tensor(offsets, dtype=torch.int64), "topk_ids": top_ids,
                   "topk_logprobs": top_logp}, str(tmp / "taps.safetensors"),
                  metadata={"gen_dtype": gen_dtype, "fingerprint": fingerprint})
        (tmp / "sequences.json").write_text(json.dumps(seqs))
        share_permissions(tmp)
        (tmp / "taps.safetensors").replace(cache / "taps.safetensors")
        (tmp / "sequences.json").replace(cache / "sequences.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for left in cache.glob(".partial-*"):  # also those of interrupted runs with another --gen-batch/dtype
        shutil.rmtree(left, ignore_errors=True)
    return {"taps": taps_t, "offsets": offsets, "topk_ids": top_ids, "topk_logprobs": top_logp}


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
            # (caches written before distributions were recorded have none: hard labels only)
            dist = ({"topk_ids": f.get_tensor("topk_ids"), "topk_logprobs": f.get_tensor("topk_logprobs")}
                    if "topk_ids" in f.keys() else {"topk_ids": None, "topk_logprobs": None})
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # (JSONDecodeError is a ValueError)
        raise DFlashError(f"data cache {cache} is damaged ({type(exc).__name__}: {exc}){damaged}") from None
    ok = (isinstance(seqs, list) and len(offsets) == len(seqs) + 1 and offsets[-1] == taps.shape[0]
          and (dist["topk_ids"] is None or dist["topk_ids"].shape[0] == dist["topk_logprobs"].shape[0] == taps.shape[0])
          and all(isinstance(s, dict) and isinstance(s.get("ids"), list) and offsets[i + 1] - offsets[i] == len(s["ids"])
                  and isinstance(s.get("prompt_len"), int) and 0 <= s["prompt_len"] <= len(s["ids"])
                  and all(type(t) is int and t >= 0 for t in s["ids"]) for i, s in enumerate(seqs)))
    if not ok:
        raise DFlashError(f"data cache {cache}: sequences.json and taps.safetensors disagree (another run's files?){damaged}")
    # caches written before the dtype was recorded: unknown
    return {"sequences": seqs, "taps": taps, "offsets": offsets, **dist, "gen_dtype": meta.get("gen_dtype", "unknown")}


def _read_piece(path: Path, prompt_ids: list, fingerprint: str) -> tuple[list[dict], list, list] | None:
    """One generate call's saved output (sequences, fp16 feature rows, distribution rows), or None if
    absent, unreadable or made for other prompts or settings (then the call runs again)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if json.loads(meta.get("prompt_ids", "null")) != prompt_ids or meta.get("fingerprint", "") != fingerprint:
                return None
            seqs = json.loads(meta["sequences"])
            dists = [(f.get_tensor(f"topk_ids{j}"), f.get_tensor(f"topk_logprobs{j}")) for j in range(len(seqs))]
            return seqs, [f.get_tensor(f"row{j}") for j in range(len(seqs))], dists
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
    with_dist = all(part.get("topk_ids") is not None for part in parts)  # (else hard labels only)
    dist = {"topk_ids": torch.cat([p["topk_ids"] for p in parts]) if with_dist else None,
            "topk_logprobs": torch.cat([p["topk_logprobs"] for p in parts]) if with_dist else None}
    for part in parts:
        seqs.extend(part["sequences"])
        offsets.extend(base + o for o in part["offsets"][1:])
        taps[base : base + part["offsets"][-1]] = part["taps"]
        part["taps"] = part["topk_ids"] = part["topk_logprobs"] = None  # free each part once copied: peak memory is the data plus one part
        base += part["offsets"][-1]
    dtypes = sorted({part["gen_dtype"] for part in parts})
    return {"sequences": seqs, "taps": taps, "offsets": offsets, **dist,
            "gen_dtype": dtypes[0] if len(dtypes) == 1 else f"mixed ({', '.join(dtypes)})"}


@dataclass
class TrainingData:
    """The sequences a `train-draft` run samples from, with what its record says about them.

    Attributes:
        sequences: the usable sequences (a response of at least 2 tokens: one anchor and one label),
            in data order; each {"id", "category", "prompt_len", "ids"}.
        rows: per usable sequence, its index in the data set (its features are rows
            offsets[i]:offsets[i + 1] of taps).
        taps / offsets: fp16 tap features of every position `[total, k*d]` and each sequence's first row.
        topk_ids / topk_logprobs: the target's top-K next-token ids (int32) and log-probabilities (fp16)
            `[total, K]` per position (row t: the distribution of the token at t), or None for data cached
            before they were recorded (hard labels only).
        gen_dtype: the dtype the data were generated in (read from the data: a reused cache may differ).
        gen_seconds: time spent generating (or reading) the data.
        prompt_files / prompts_sha256 / target_sha256: the inputs, as the record names them.
    """

    sequences: list[dict]
    rows: list[int]
    taps: object
    offsets: list[int]
    gen_dtype: str
    gen_seconds: float
    prompt_files: list[Path]
    prompts_sha256: list[str]
    target_sha256: dict[str, str]
    topk_ids: object = None
    topk_logprobs: object = None

    def features(self, n: int):
        """The fp16 tap features `[len(ids), k*d]` of usable sequence `n`."""
        i = self.rows[n]
        return self.taps[self.offsets[i] : self.offsets[i + 1]]

    def distribution(self, n: int):
        """The target's top-K (int32 ids, fp16 log-probabilities), each `[len(ids), K]`, of usable sequence `n`."""
        i = self.rows[n]
        return self.topk_ids[self.offsets[i] : self.offsets[i + 1]], self.topk_logprobs[self.offsets[i] : self.offsets[i + 1]]


def prepare_training_data(args, tspec, target_dir: Path, taps: tuple[int, ...], device) -> TrainingData:
    """Read `--prompts`, generate (or reuse from each file's cache) the target's responses and their tap
    features, and keep the sequences long enough to train on.

    Raises:
        DFlashError: a bad prompt file or an id used in two files; damaged or mismatched cached data
            (see :func:`generate_dataset`); data outside the target's vocabulary; no usable sequence.
    """

    prompt_files = [Path(f) for f in args.prompts]
    prompt_sets = read_prompt_sets(prompt_files, args.max_prompts)
    gen_dtype = autocast_dtype(args.gen_dtype, device)
    # hashed once: for cache keys and the record (a multi-GB target takes a while)
    target_sha = {f.name: file_sha256(f) for f in sorted(Path(target_dir).glob("*.safetensors"))}
    prompts_sha = [file_sha256(f) for f in prompt_files]
    t0 = time.time()
    parts = []
    for i, rows in enumerate(prompt_sets):
        # one cache per prompt file, so adding a file later reuses the data of the others
        key = _cache_key(list(target_sha.values()), prompts_sha[i], args, taps, gen_dtype, is_text_set(rows))
        data_dir = Path(args.data_cache[i]) if args.data_cache else cache_dir() / "train-data" / key
        parts.append(generate_dataset(target_dir, rows, taps, data_dir, args.max_new_tokens, args.gen_batch,
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
        raise DFlashError(f"no training data: every response (or text row after its first token) is shorter than 2 "
                          f"tokens (--max-new-tokens {args.max_new_tokens}); raise --max-new-tokens or use other "
                          "prompts or longer text")
    if getattr(args, "distill", "none") != "none" and data.get("topk_ids") is None:
        raise DFlashError("--distill needs the target's distributions, which a data cache written before they were "
                          "recorded lacks; pass a new --data-cache directory (or delete the old one) to regenerate")
    return TrainingData(sequences=seqs, rows=usable, taps=data["taps"], offsets=data["offsets"],
                        gen_dtype=data["gen_dtype"], gen_seconds=gen_seconds, prompt_files=prompt_files,
                        prompts_sha256=prompts_sha, target_sha256=target_sha, topk_ids=data.get("topk_ids"),
                        topk_logprobs=data.get("topk_logprobs"))


def _cache_key(target_hashes: list[str], prompts_hash: str, args, taps, gen_dtype, text: bool = False) -> str:
    """The data cache key (and fingerprint) of one prompt file: a hash of everything its data depend on."""
    return hashlib.sha256(
        json.dumps(
            target_hashes + [prompts_hash, args.max_prompts, args.max_new_tokens, list(taps)]
            # (only when used, so caches of greedy-only fp32 data keep their key)
            + ([args.responses_per_prompt, args.sample_temperature, args.seed]
               if args.responses_per_prompt > 1 and not text else [])
            + (["bf16"] if gen_dtype is not None else [])
        ).encode()
    ).hexdigest()[:16]
