"""Several clients at once through the server: the batched server (`serve --max-batch M`) with its default
(auto) speculation and with plain batched decoding (the same server, requests asking `block_size` 1), against
the one-at-a-time server (`--max-batch 1`, speculative decoding), in one run.

    python -m dflash_export.eval.serving.batch_bench ARTIFACT [--streams 1,2,4,8] [--max-tokens 64] [--limit 2]
        [--rounds 2] [--max-batch 8] [--per-stream 2] [--compare-lone]

The artifact must be built with `--batched`. Both servers run as subprocesses (`python -m runtime serve`),
idle while the other is loaded. For each N in --streams and each round, each mode (their order
rotating) gets N concurrent streaming chat clients (the official openai client, one thread each)
working through the held-out prompts (`models/prompts/eval.jsonl`, --limit per category, greedy,
--max-tokens each; at least --per-stream x N requests, 2 by default). Printed per server and N, medians over
rounds: aggregate decode tokens/s (completion tokens of all requests / the load's wall time, first
token included; for the batched modes also over plain batched decoding's at the same N), the aggregate
while all N clients are busy (`steady_tok_s`: the load's tail, where fewer requests remain than clients,
left out), p50/p95 time to first token, p50/p95 gap between streamed chunks (inter-token latency;
a speculative chunk can carry several tokens), the share of the batched server's decoding steps that
verified proposals, its decode tokens/s (tokens of its decoding steps / their seconds, host work included:
prompt processing apart, which costs the same per request at any batch size) and the share of its busy
time spent prefilling prompts (its /health counters), and replies that differ from the one-at-a-time
server's reply to the same prompt with one client.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from pathlib import Path

from dflash_export.eval.decoding.bench import DEFAULT_EVAL, eval_prompts
from dflash_export.eval.serving.serve_bench import MODEL, ServerProcess


def one_request(client, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed greedy chat request (`extra`: more request fields, e.g. verify_len): its text, completion
    tokens, TTFT and chunk gaps (seconds)."""
    t0 = time.perf_counter()
    stamps, text, tokens = [], [], 0
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                                         max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                                         extra_body=extra)
    for chunk in out:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"prompt": prompt, "text": "".join(text), "tokens": tokens,
            "ttft": (stamps[0] if stamps else time.perf_counter()) - t0, "gaps": gaps, "start": t0,
            "end": time.perf_counter()}


def load(url: str, prompts: list[str], streams: int, max_tokens: int, extra: dict | None = None,
         per_stream: int = 2) -> tuple[float, list[dict]]:
    """`streams` clients working through `prompts` (repeated to at least `per_stream` per client), each
    request with the fields `extra`. Returns (wall seconds, per-request records)."""
    import openai

    work: queue.Queue = queue.Queue()
    todo = list(prompts)
    while len(todo) < per_stream * streams:
        todo += prompts
    for p in todo:
        work.put(p)
    records, lock = [], threading.Lock()

    def client_thread(client: int):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        while True:
            try:
                p = work.get_nowait()
            except queue.Empty:
                break
            r = one_request(c, p, max_tokens, extra)
            with lock:
                records.append({**r, "client": client})
        c.close()

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, records


def pct(values: list[float], q: float) -> float:
    values = sorted(values) or [0.0]
    return values[min(len(values) - 1, int(q * len(values)))]


def steady_tok_s(records: list[dict]) -> float:
    """Aggregate tokens/s while every client is busy: from the first request's start until the first
    client runs out of work (its last request's end), each request's tokens counted evenly over its own
    time. The whole load's figure also counts its tail, where fewer requests remain than clients."""
    start = min(r["start"] for r in records)
    end = min(max(r["end"] for r in records if r["client"] == c) for c in {r["client"] for r in records})
    inside = sum(r["tokens"] * max(0.0, min(r["end"], end) - max(r["start"], start)) / max(r["end"] - r["start"], 1e-9)
                 for r in records)
    return inside / max(end - start, 1e-9)


def summarize(seconds: float, records: list[dict], reference: dict[str, str]) -> dict:
    gaps = [g for r in records for g in r["gaps"]]
    ttft = [r["ttft"] for r in records]
    return {"tok_s": sum(r["tokens"] for r in records) / seconds, "steady_tok_s": steady_tok_s(records),
            "ttft50": pct(ttft, 0.5), "ttft95": pct(ttft, 0.95),
            "itl50": pct(gaps, 0.5), "itl95": pct(gaps, 0.95),
            "differ": sum(reference.get(r["prompt"], r["text"]) != r["text"] for r in records), "n": len(records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_export.eval.serving.batch_bench", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=2, help="held-out prompts per category")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8, help="the batched server's slots")
    p.add_argument("--prompts", default=str(DEFAULT_EVAL))
    p.add_argument("--per-stream", type=int, default=2, help="requests each client sends at least (more: a shorter tail)")
    p.add_argument("--compare-lone", action="store_true",
                   help="also a batched server with --no-lone-graph (a lone stream on the batched graph), in the same run")
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    prompts = eval_prompts(Path(args.prompts), args.limit)
    batched = f"--max-batch {args.max_batch}"
    servers = {"one": ServerProcess(args.artifact, "ort", ["--max-batch", "1"]),
               "batched": ServerProcess(args.artifact, "ort", ["--max-batch", str(args.max_batch)])}
    modes = {"one at a time (--max-batch 1, speculative)": ("one", None),
             f"batched ({batched}), default (auto)": ("batched", None),
             f"batched ({batched}), plain (block_size 1)": ("batched", {"block_size": 1})}
    if args.compare_lone:
        servers["no-lone"] = ServerProcess(args.artifact, "ort", ["--max-batch", str(args.max_batch), "--no-lone-graph"])
        modes = {**dict(list(modes.items())[:2]), f"batched ({batched}, --no-lone-graph), default (auto)": ("no-lone", None),
                 **dict(list(modes.items())[2:])}
    names = list(modes)
    try:
        _, alone = load(servers["one"].url, prompts, 1, args.max_tokens)
        reference = {r["prompt"]: r["text"] for r in alone}
        results: dict[tuple[str, int], list[dict]] = {}
        for rnd in range(args.rounds):
            for n in streams:
                shift = (rnd + n) % len(names)
                for name in names[shift:] + names[:shift]:
                    server, extra = modes[name]
                    before = _health(servers[server].url)
                    seconds, records = load(servers[server].url, prompts, n, args.max_tokens, extra, args.per_stream)
                    row = {**summarize(seconds, records, reference),
                           **_engine_rates(before, _health(servers[server].url))}
                    results.setdefault((name, n), []).append(row)
                    print(f"round {rnd + 1}, {n} streams, {name}: {row['tok_s']:.1f} tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = lambda key, runs: statistics.median(r[key] for r in runs)  # noqa: E731
    print(f"\n{len(prompts)} held-out prompts, {args.max_tokens} tokens each, greedy, {args.rounds} rounds (medians)\n")
    print("| server | streams | aggregate tok/s | vs 1 stream | vs plain batched | all clients busy: tok/s, vs 1 stream |"
          " decode tok/s (engine), vs 1 stream | prompt processing share | TTFT p50 / p95 ms | inter-token p50 / p95 ms |"
          " speculative steps | replies differing from one client |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    plain = names[-1]
    for name in names:
        base, steady_base = med("tok_s", results[name, streams[0]]), med("steady_tok_s", results[name, streams[0]])
        for n in streams:
            runs = results[name, n]
            tok_s, steady = med("tok_s", runs), med("steady_tok_s", runs)
            vs_plain = f"{tok_s / med('tok_s', results[plain, n]):.2f}x" if modes[name][0] != "one" else "-"
            print(f"| {name} | {n} | {tok_s:.1f} | {tok_s / base:.2f}x | {vs_plain} | {steady:.1f}, {steady / steady_base:.2f}x | "
                  f"{_decode_rate(runs, results[name, streams[0]])} | {_share(runs, 'prefill_share')} | "
                  f"{med('ttft50', runs) * 1e3:.0f} / {med('ttft95', runs) * 1e3:.0f} | "
                  f"{med('itl50', runs) * 1e3:.1f} / {med('itl95', runs) * 1e3:.1f} | {_share(runs)} | "
                  f"{sum(r['differ'] for r in runs)} of {sum(r['n'] for r in runs)} |")
    return 0


def _health(url: str) -> dict:
    """The server's /health counters."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read())


def _engine_rates(before: dict, after: dict) -> dict:
    """What a batched server's counters say about one load: the share of its decoding steps that verified
    proposals, its decode tokens/s (tokens of decoding steps / their seconds: prompt processing apart) and
    the share of its busy time spent prefilling prompts. None where the server has no such counters."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("steps", "speculative_steps", "decoded_tokens",
                                                               "decode_seconds", "prefill_seconds")}
    busy = delta["decode_seconds"] + delta["prefill_seconds"]
    return {"spec_share": delta["speculative_steps"] / delta["steps"] if delta["steps"] else None,
            "decode_tok_s": delta["decoded_tokens"] / delta["decode_seconds"] if delta["decode_seconds"] else None,
            "prefill_share": delta["prefill_seconds"] / busy if busy else None}


def _share(runs: list[dict], key: str = "spec_share") -> str:
    shares = [r[key] for r in runs if r[key] is not None]
    return f"{100 * statistics.median(shares):.0f}%" if shares else "-"


def _decode_rate(runs: list[dict], first: list[dict]) -> str:
    """Median decode tokens/s of `runs` and its ratio to `first`'s (the 1-stream runs): '-' without counters."""
    rates, base = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]], [r["decode_tok_s"] for r in first if r["decode_tok_s"]]
    if not rates or not base:
        return "-"
    return f"{statistics.median(rates):.1f}, {statistics.median(rates) / statistics.median(base):.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())
