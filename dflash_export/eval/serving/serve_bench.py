"""Streaming through the OpenAI-compatible server against the in-process runtime, and KV reuse in chat.

    python scripts/serve_bench.py ARTIFACT_DIR [--repeats 5] [--max-tokens 96] [--chat-tokens 48]
        [--backend ort] [--prompt TEXT]

1. One chat prompt, greedy: time to first token (TTFT) and decode tokens/s in-process
   (`Session.stream`) and through `python -m runtime serve` (a subprocess; the openai client,
   streaming, `stream_options.include_usage`). KV reuse is off for both, so every run prefills the
   whole prompt. The two take turns each repeat (the order alternating) so machine noise hits them alike;
   the figures are medians.
2. A 4-turn chat through the server: each turn's TTFT with KV reuse (the default: the turns before it
   are not prefilled again) and without (`reuse_prefix: false`), the modes taking turns; medians per turn,
   with the prompt tokens and how many the server reports as cached.
3. Load (with --load-clients > 0): that many concurrent clients each send --load-requests greedy
   requests (chat and completions, streamed and not, taking turns) to the one server: failed requests,
   replies that differ from the same request sent alone, requests/s, latency percentiles and the
   server's resident memory before and after (after a warm-up round).

Needs the serve extra and the openai client: pip install 'dflash_export[serve]' openai.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = "bench"
TURNS = [
    "What is a KV cache in a transformer?",
    "Why does it make decoding faster?",
    "How much memory does it need for a 135M-parameter model with 2048 tokens?",
    "Summarize all of that in one sentence.",
]


@dataclass
class Run:
    """One streamed reply: seconds to the first text, decode and overall tokens/s, and what it said."""

    ttft: float
    decode_tps: float
    total_tps: float
    text: str
    prompt_tokens: int = 0
    cached: int = 0


def _run(t0: float, first: float | None, end: float, n: int, text: str, **more) -> Run:
    first = end if first is None else first
    decode = (n - 1) / (end - first) if n > 1 and end > first else 0.0
    return Run(first - t0, decode, n / (end - t0), text, **more)


def in_process(sess, messages: list[dict], max_tokens: int) -> Run:
    """`Session.stream` without KV reuse."""
    t0, first, parts = time.perf_counter(), None, []
    with sess.stream(messages=messages, max_new_tokens=max_tokens, reuse_prefix=False) as st:
        for chunk in st:
            if chunk.text and first is None:
                first = time.perf_counter()
            parts.append(chunk.text)
    end = time.perf_counter()
    return _run(t0, first, end, len(st.result.output_ids), "".join(parts), prompt_tokens=st.result.prompt_tokens)


def through_server(client, messages: list[dict], max_tokens: int, reuse: bool) -> Run:
    """One streamed chat completion (greedy) through the server."""
    t0, first, parts, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"reuse_prefix": reuse})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                parts.append(choice.delta.content)
    end = time.perf_counter()
    details = usage.prompt_tokens_details
    return _run(t0, first, end, usage.completion_tokens, "".join(parts), prompt_tokens=usage.prompt_tokens,
                cached=details.cached_tokens if details is not None else 0)


class ServerProcess:
    """`python -m runtime serve DIR --port 0` in a subprocess (its own interpreter and GIL, as deployed)."""

    def __init__(self, artifact: str, backend: str, extra: list[str] | None = None):
        cmd = [sys.executable, "-m", "runtime", "serve", artifact, "--port", "0", "--backend", backend,
               "--model-name", MODEL, *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in self.proc.stderr:
            lines.append(line)
            if line.startswith("serving"):
                break
        else:
            raise SystemExit("the server did not start:\n" + "".join(lines[-20:]))
        self.url = line.split(" on ")[1].split(" ")[0]
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep its pipe drained

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def single_prompt(sess, client, prompt: str, max_tokens: int, repeats: int) -> tuple[dict[str, list[Run]], bool]:
    """Part 1: the runs of each side, and whether every run said the same."""
    messages = [{"role": "user", "content": prompt}]
    runs: dict[str, list[Run]] = {"in-process Session.stream": [], "server (openai client, streamed)": []}
    sides = list(runs)
    in_process(sess, messages, 8)  # warm-up of both sides
    through_server(client, messages, 8, reuse=False)
    for r in range(repeats):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            run = in_process(sess, messages, max_tokens) if side == sides[0] else \
                through_server(client, messages, max_tokens, reuse=False)
            runs[side].append(run)
    texts = {run.text for rs in runs.values() for run in rs}
    return runs, len(texts) == 1


def conversation(client, max_tokens: int, reuse: bool, tag: str) -> list[Run]:
    """Part 2: the turns of one chat (its own system prompt, so it shares little with the last one)."""
    messages = [{"role": "system", "content": f"You are a concise assistant ({tag})."}]
    runs = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        run = through_server(client, messages, max_tokens, reuse)
        messages.append({"role": "assistant", "content": run.text})
        runs.append(run)
    return runs


def chat_turns(client, max_tokens: int, repeats: int) -> dict[bool, list[list[Run]]]:
    out: dict[bool, list[list[Run]]] = {True: [], False: []}
    for r in range(repeats):
        for reuse in ((True, False) if r % 2 == 0 else (False, True)):
            out[reuse].append(conversation(client, max_tokens, reuse, f"run {r}"))
    return out


LOAD_PROMPTS = ["Name a fruit.", "What is 7 times 8?", "Say hello in French.", "Name a prime number."]


def _load_request(client, i: int, max_tokens: int) -> str:
    """Request i of the load mix: prompt i mod 4; chat or completion and streamed or not taking turns."""
    prompt, stream, chat = LOAD_PROMPTS[i % len(LOAD_PROMPTS)], (i // 2) % 2 == 0, i % 2 == 0
    kw = dict(model=MODEL, max_tokens=max_tokens, temperature=0, stream=stream)
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream else \
            out.choices[0].message.content
    out = client.completions.create(prompt=prompt, **kw)
    return "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text


def _server_rss(pid: int) -> int:
    """Resident bytes of the server process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Load:
    """Part 3's figures."""

    requests: int
    failed: int
    differing: int
    seconds: float
    latencies: list
    rss_before: int
    rss_after: int


def load_test(server, url: str, clients: int, requests: int, max_tokens: int) -> Load:
    """Part 3: `clients` threads, each with its own openai client, `requests` requests each."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    def client_run(seed: int, n: int, want: dict | None) -> tuple[int, int, list]:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        failed = differing = 0
        lat = []
        for r in range(n):
            i = seed + r
            t0 = time.perf_counter()
            try:
                text = _load_request(c, i, max_tokens)
            except openai.OpenAIError:
                failed += 1
                continue
            lat.append(time.perf_counter() - t0)
            differing += want is not None and text != want[i % 4, i % 2 == 0]
        c.close()
        return failed, differing, lat

    alone = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    want = {(i % 4, i % 2 == 0): _load_request(alone, i, max_tokens) for i in range(8)}
    alone.close()

    def round_(n: int) -> tuple[int, int, list]:
        with ThreadPoolExecutor(clients) as pool:
            res = [f.result() for f in [pool.submit(client_run, s, n, want) for s in range(clients)]]
        return sum(r[0] for r in res), sum(r[1] for r in res), [x for r in res for x in r[2]]

    round_(2)  # warm-up: connections, allocator pools
    before, t0 = _server_rss(server.proc.pid), time.perf_counter()
    failed, differing, lat = round_(requests)
    seconds = time.perf_counter() - t0
    return Load(clients * requests, failed, differing, seconds, lat, before, _server_rss(server.proc.pid))


def print_load(load: Load, clients: int, max_tokens: int) -> None:
    lat = sorted(load.latencies) or [0.0]
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3  # noqa: E731
    print(f"\n3. load: {clients} concurrent clients x {load.requests // clients} greedy requests, up to {max_tokens}"
          f" tokens each (chat/completions, streamed or not)\n")
    print("| requests | failed | replies differing from alone | seconds | requests/s | latency p50 / p95 / max ms |"
          " server RSS before -> after MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {load.requests} | {load.failed} | {load.differing} | {load.seconds:.1f} | {load.requests / load.seconds:.2f}"
          f" | {pct(0.5):.0f} / {pct(0.95):.0f} / {lat[-1] * 1e3:.0f} |"
          f" {load.rss_before / 2**20:.1f} -> {load.rss_after / 2**20:.1f} |")


def med(values) -> float:
    return statistics.median(values)


def print_tables(sess, args, runs: dict[str, list[Run]], same: bool, chats: dict[bool, list[list[Run]]]) -> None:
    name = sess.manifest.get("sources", {}).get("target", {}).get("name") or Path(args.dir).name
    ref = next(iter(runs.values()))[0]
    print(f"\n{name}, {args.backend}, {os.cpu_count()} cores; greedy, medians of {args.repeats} interleaved runs")
    print(f"1. one chat prompt ({ref.prompt_tokens} tokens), up to {args.max_tokens} new tokens, no KV reuse"
          f" (replies identical: {'yes' if same else 'NO'})\n")
    print(f"| {'':34} | TTFT ms | decode tok/s | tok/s incl. prefill |")
    print(f"|{'-' * 36}|--------:|-------------:|--------------------:|")
    for side, rs in runs.items():
        print(f"| {side:34} | {med(r.ttft for r in rs) * 1e3:7.1f} | {med(r.decode_tps for r in rs):12.1f} |"
              f" {med(r.total_tps for r in rs):19.1f} |")
    print(f"\n2. {len(TURNS)}-turn chat through the server, up to {args.chat_tokens} tokens per reply: TTFT per turn\n")
    print("| turn | prompt tokens | cached (reuse on) | TTFT ms, reuse on | TTFT ms, reuse off |")
    print("|-----:|--------------:|------------------:|------------------:|-------------------:|")
    for t in range(len(TURNS)):
        on = [c[t] for c in chats[True]]
        off = [c[t] for c in chats[False]]
        print(f"| {t + 1:4} | {med(r.prompt_tokens for r in on):13.0f} | {med(r.cached for r in on):17.0f} |"
              f" {med(r.ttft for r in on) * 1e3:17.1f} | {med(r.ttft for r in off) * 1e3:18.1f} |")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command line (`scripts/serve_bench.py`); returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="artifact directory (e.g. artifacts/smollm2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--backend", default="ort", choices=("ort", "ort-cuda", "trt"))
    p.add_argument("--load-clients", type=int, default=8, help="part 3's concurrent clients (0: skip it)")
    p.add_argument("--load-requests", type=int, default=25, help="part 3's requests per client")
    p.add_argument("--load-tokens", type=int, default=16, help="part 3's max_tokens per request")
    p.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number.")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 2 or args.chat_tokens < 1:
        p.error("--repeats and --chat-tokens must be >= 1, --max-tokens >= 2")
    if args.load_clients < 0 or args.load_requests < 1 or args.load_tokens < 1:
        p.error("--load-clients must be >= 0, --load-requests and --load-tokens >= 1")
    try:
        import openai
    except ImportError:
        raise SystemExit("error: the benchmark needs the openai client: pip install openai") from None
    import runtime

    try:
        sess = runtime.load(args.dir, backend=args.backend)
    except runtime.DFlashError as exc:
        raise SystemExit(f"error: {exc}") from None
    if sess.tokenizer is None or not sess.tokenizer.chat_template:  # before the server starts
        raise SystemExit(f"error: {args.dir} has no chat template; the benchmark's requests are chat turns")
    server = ServerProcess(args.dir, args.backend)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
        runs, same = single_prompt(sess, client, args.prompt, args.max_tokens, args.repeats)
        chats = chat_turns(client, args.chat_tokens, args.repeats)
        load = load_test(server, server.url, args.load_clients, args.load_requests, args.load_tokens) \
            if args.load_clients else None
    finally:
        server.stop()
    print_tables(sess, args, runs, same, chats)
    if load is not None:
        print_load(load, args.load_clients, args.load_tokens)
    sess.close()
    return 0
