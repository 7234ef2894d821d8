"""Batched greedy decode throughput of an onnxruntime-genai model (peer baseline).

    PEER_VENV/bin/python scripts/ortgenai_batch.py --model DIR --batch 1,2,4,8 --max-new-tokens 64 \
        --limit 2 --threads 2 --ignore-eos

Run it from an environment with onnxruntime-genai (a peer, never a dependency of this project); its
model comes from onnxruntime-genai's builder, e.g. `python -m onnxruntime_genai.models.builder -i HF_DIR
-o DIR -p int4 -e cpu --extra_options block_size=32 accuracy_level=4`. `scripts/batch_static.py` runs
the same batches on this project's `BatchEngine`.

For each batch size N the prompts (chat template, one user turn) are run in consecutive batches of N
(right-padded with a pad id, as genai's encode_batch does), one `Generator` per batch. Timing per
batch: prefill = append_tokens + the first generate_next_token (it samples the prefill's token); decode = every later generate_next_token.
Prints one JSON line per N. decode_tok_s_aggregate = decode tokens of all rows / decode seconds.

EOS: by default a row stops counting after it emits EOS (the EOS token itself counts; per-row state is
read from get_next_tokens, since the generator only exposes is_done() for the whole batch; finished rows
still ride along in the batch until all are done or max_new_tokens is reached). --ignore-eos instead
sets min_length = max_length, so EOS is masked and every row makes exactly max_new_tokens tokens.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og


def eval_prompts(path: str, limit: int | None) -> list[str]:
    """Prompt texts of the eval set, at most `limit` per category, in file order (as the project's bench)."""
    out, seen = [], {}
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            cat = row.get("category", "")
            if limit is None or seen.get(cat, 0) < limit:
                seen[cat] = seen.get(cat, 0) + 1
                out.append(row["prompt"])
    return out


def encode(tok, text: str) -> list[int]:
    try:
        text = tok.apply_chat_template(json.dumps([{"role": "user", "content": text}]), add_generation_prompt=True)
    except Exception:  # no chat template: plain prompt
        pass
    return [int(t) for t in tok.encode(text)]


def run_batch(model, rows: list[list[int]], n_new: int, pad: int, eos: set[int], ignore_eos: bool):
    """One batched greedy generation; returns (prefill_s, decode_s, decode_tokens, outputs)."""
    n = len(rows)
    width = max(map(len, rows))
    ids = np.full((n, width), pad, dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r  # right padding, as genai's Tokenizer.encode_batch pads
    params = og.GeneratorParams(model)
    max_length = width + n_new
    opts = dict(do_sample=False, max_length=max_length, batch_size=n)
    if ignore_eos:
        opts["min_length"] = max_length
    params.set_search_options(**opts)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()  # the prefill's token
    first = gen.get_next_tokens()
    t1 = time.perf_counter()
    outs = [[int(t)] for t in first]
    done = [(not ignore_eos) and int(t) in eos for t in first]
    tokens = steps = 0
    while not gen.is_done() and steps < n_new - 1:
        gen.generate_next_token()
        steps += 1
        nxt = gen.get_next_tokens()
        for i, t in enumerate(nxt):
            if done[i]:
                continue
            tokens += 1
            outs[i].append(int(t))
            if not ignore_eos and int(t) in eos:
                done[i] = True
    t2 = time.perf_counter()
    del gen
    return t1 - t0, t2 - t1, tokens, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "models" / "prompts" / "eval.jsonl"))
    p.add_argument("--limit", type=int, default=16, help="prompts per category")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ignore-eos", action="store_true", help="min_length = max_length: all rows make max_new_tokens")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up batches per batch size")
    p.add_argument("--show", action="store_true", help="print decoded outputs of the first batch (stderr)")
    args = p.parse_args()

    with open(f"{args.model}/genai_config.json") as fh:
        gcfg = json.load(fh)["model"]
    eos_cfg = gcfg.get("eos_token_id", [])
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg])

    # Tokenizer first (from the model as built) to encode prompts and choose a pad id.
    base = og.Model(args.model)
    tok = og.Tokenizer(base)
    prompts = [encode(tok, t) for t in eval_prompts(args.prompts, args.limit)]
    del tok, base
    # genai masks every input token equal to pad_token_id. SmolLM2's pad (= eos = <|im_end|>) occurs inside
    # chat prompts, so pad with a token id that no prompt contains (0 = <|endoftext|> for SmolLM2).
    used = {t for r in prompts for t in r}
    pad = gcfg.get("pad_token_id", 0)
    if pad in used:
        pad = next(t for t in range(gcfg["vocab_size"]) if t not in used)

    config = og.Config(args.model)
    config.overlay(json.dumps({"model": {"pad_token_id": pad, "decoder": {"session_options": {
        "intra_op_num_threads": args.threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    tok = og.Tokenizer(model)

    mode = "ignore_eos(min_length=max_length)" if args.ignore_eos else "stop_at_eos(per-row via get_next_tokens)"
    for n in [int(b) for b in args.batch.split(",") if b.strip()]:
        chunks = [prompts[i:i + n] for i in range(0, len(prompts), n)]
        for c in chunks[:args.warmup]:
            run_batch(model, c, min(8, args.max_new_tokens), pad, eos, args.ignore_eos)
        pre = dec = 0.0
        toks = 0
        for ci, c in enumerate(chunks):
            ps, ds, t, outs = run_batch(model, c, args.max_new_tokens, pad, eos, args.ignore_eos)
            pre += ps
            dec += ds
            toks += t
            if args.show and ci == 0:
                import sys
                for o in outs:
                    print(f"[batch {n}] {tok.decode(np.array(o, dtype=np.int32))!r}", file=sys.stderr)
        print(json.dumps({"batch": n, "decode_tok_s_aggregate": round(toks / dec, 2) if dec else 0.0,
                          "tokens": toks, "seconds": round(dec, 4), "prefill_s": round(pre, 4),
                          "prompts": len(prompts), "batches": len(chunks), "max_new_tokens": args.max_new_tokens,
                          "threads": args.threads, "pad_token_id": pad, "eos_mode": mode}), flush=True)


if __name__ == "__main__":
    main()
