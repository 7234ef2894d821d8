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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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

    def __init__(self, artifact: str, backend: str):
        cmd = [sys.executable, "-m", "runtime", "serve", artifact, "--port", "0", "--backend", backend,
               "--model-name", MODEL]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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


def med(values) -> float:
    return statistics.median(values)


def print_tables(sess, args, runs: dict[str, list[Run]], same: bool, chats: dict[bool, list[list[Run]]]) -> None:
    name = sess.manifest.get("sources", {}).get("target", {}).get("name", Path(args.dir).name)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="artifact directory (e.g. artifacts/smollm2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--backend", default="ort", choices=("ort", "ort-cuda", "trt"))
    p.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number.")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 2 or args.chat_tokens < 1:
        p.error("--repeats and --chat-tokens must be >= 1, --max-tokens >= 2")
    try:
        import openai
    except ImportError:
        raise SystemExit("error: the benchmark needs the openai client: pip install openai") from None
    import runtime

    try:
        sess = runtime.load(args.dir, backend=args.backend)
    except runtime.DFlashError as exc:
        raise SystemExit(f"error: {exc}") from None
    server = ServerProcess(args.dir, args.backend)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
        runs, same = single_prompt(sess, client, args.prompt, args.max_tokens, args.repeats)
        chats = chat_turns(client, args.chat_tokens, args.repeats)
    finally:
        server.stop()
    print_tables(sess, args, runs, same, chats)
    sess.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
