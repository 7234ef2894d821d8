"""Decode-speed workers for scripts/peer_bench.py, run under the interpreter that has the peer installed.

    python peer_workers.py genai MODEL_DIR PROMPTS.json MAX_NEW_TOKENS THREADS
    python peer_workers.py llama GGUF_FILE PROMPTS.json MAX_NEW_TOKENS THREADS

PROMPTS.json is a list of prompt token-id lists (the same ids every runtime gets). Prints one JSON
list: greedy decode tokens/s per prompt, first token (the prefill) excluded, after one warm-up
prompt. Imports nothing from this project, so it runs in the peer's own environment.
"""

from __future__ import annotations

import json
import sys
import time


def genai_rates(model_dir: str, prompts: list[list[int]], n_new: int, threads: int) -> list[float]:
    """onnxruntime-genai: greedy `Generator` loop, one `generate_next_token` per token."""
    import onnxruntime_genai as og

    config = og.Config(model_dir)
    model = og.Model(config)
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
    return rates[1:]


def llama_rates(gguf: str, prompts: list[list[int]], n_new: int, threads: int) -> list[float]:
    """llama.cpp (llama-cpp-python): greedy `generate`, one token at a time, end-of-text ignored."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
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
    return rates[1:]


def main() -> int:
    kind, model, prompts_path, n_new, threads = sys.argv[1:6]
    prompts = json.loads(open(prompts_path).read())
    run = {"genai": genai_rates, "llama": llama_rates}[kind]
    print(json.dumps(run(model, prompts, int(n_new), int(threads))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
