"""Decode-speed workers for `dflash_export.eval.peers.peer_bench`: each run loads ONE runtime in a fresh process.

Run as a file, never imported (the peers' interpreters need not have this project installed):

    python peer_workers.py genai MODEL_DIR PROMPTS.json MAX_NEW_TOKENS THREADS   # the peer's interpreter
    python peer_workers.py llama GGUF_FILE PROMPTS.json MAX_NEW_TOKENS THREADS
    python peer_workers.py ours ARTIFACT_DIR PROMPTS.json MAX_NEW_TOKENS THREADS  # ours (imports `runtime`)

PROMPTS.json is a list of prompt token-id lists (the same ids every runtime gets). Prints one JSON
object: `rates`, greedy decode tokens/s per prompt, first token (the prefill) excluded, after one
warm-up prompt; `rss_load_gib` and `rss_after_gib`, the process's resident memory after loading and
after the first generate. The peers' workers import nothing from this project, so they run in the
peer's own environment.
"""

from __future__ import annotations

import json
import os
import sys
import time

MEMORY: dict[str, float] = {}


def rss_gib() -> float:
    """This process's resident memory (GiB), from /proc (0.0 where there is none)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 30)
    except OSError:
        return 0.0


def note_memory(key: str) -> None:
    MEMORY.setdefault(key, round(rss_gib(), 2))


def genai_rates(model_dir: str, prompts: list[list[int]], n_new: int, threads: int) -> list[float]:
    """onnxruntime-genai: greedy `Generator` loop, one `generate_next_token` per token."""
    import onnxruntime_genai as og

    config = og.Config(model_dir)
    model = og.Model(config)
    note_memory("rss_load_gib")
    rates = []
    for ids in prompts[:1] + prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + n_new)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        gen.generate_next_token()  # the prefill's token
        t0, n = time.perf_counter(), 0
        while not gen.is_done() and n < n_new - 1:
            gen.generate_next_token()
            n += 1
        rates.append(n / (time.perf_counter() - t0))
        note_memory("rss_after_gib")
    return rates[1:]


def llama_rates(gguf: str, prompts: list[list[int]], n_new: int, threads: int) -> list[float]:
    """llama.cpp (llama-cpp-python): greedy `generate`, one token at a time, end-of-text ignored."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    note_memory("rss_load_gib")
    rates = []
    for ids in prompts[:1] + prompts:
        llm.reset()
        stream = llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True)
        next(stream)  # the prefill's token
        t0 = time.perf_counter()
        for n, _ in enumerate(stream, start=1):
            if n >= n_new - 1:
                break
        rates.append(n / (time.perf_counter() - t0))
        note_memory("rss_after_gib")
    return rates[1:]


def ours_rates(artifact: str, prompts: list[list[int]], n_new: int, threads: int) -> list[float]:
    """Our runtime (`runtime.load`), plain decoding (block size 1) on the same ids."""
    import runtime

    session = runtime.load(artifact, threads=threads)
    note_memory("rss_load_gib")
    rates = []
    for ids in prompts[:1] + prompts:
        res = session.generate(ids, max_new_tokens=n_new, block_size=1, stop_token_ids=[], reuse_prefix=False)
        rates.append(res.decode_tokens_per_s)
        note_memory("rss_after_gib")
    return rates[1:]


def main() -> int:
    kind, model, prompts_path, n_new, threads = sys.argv[1:6]
    prompts = json.loads(open(prompts_path).read())
    run = {"genai": genai_rates, "llama": llama_rates, "ours": ours_rates}[kind]
    rates = run(model, prompts, int(n_new), int(threads))
    print(json.dumps({"rates": rates, **MEMORY}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
