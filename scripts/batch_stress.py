#!/usr/bin/env python3
"""Load check of continuous batching: `python -m runtime serve ART --max-batch N` under mixed traffic.

    python scripts/batch_stress.py ART [--max-batch 8] [--queue-size 4] [--requests 200]

ART must be built with `python -m dflash_export build --batched`. The script starts the server as a
subprocess (port 0), then:

1. reference: each held-out prompt (models/prompts/eval.jsonl, 2 per category) and one ~2,000-token
   prompt, one client at a time (streamed chat completions, temperature 0, max_tokens 48): the
   batch-1 replies;
2. load, all at once: `--max-batch` streaming clients looping over the prompts, a burst of
   simultaneous requests that overflows the queue (429s expected, each must carry Retry-After and an
   OpenAI error body), clients that close their stream after a few chunks, and the long prompt joining
   the running batch; `--requests` requests in all.

It checks that every completed reply equals its batch-1 reference (a disconnected one: its received
text is a prefix of it), that no request is lost (no error but 429, every stream ends with a finish
reason), that /health answers 200 and shows 0 running and 0 waiting once idle, that the server logs
no traceback, and reports the server's VmRSS after the warm-up and every 50 requests (a steady rise is
a failure). Exit status 1 when a check fails.
"""

import argparse
import itertools
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import requests
from tokenizers import Tokenizer

from dflash_export.eval.decoding.bench import DEFAULT_EVAL, eval_prompts

MAX_TOKENS = 48
BURST, DISCONNECTS, LONG_TOKENS = 24, 6, 1950


def start_server(art: str, max_batch: int, queue_size: int):
    cmd = [sys.executable, "-m", "runtime", "serve", art, "--port", "0", "--max-batch", str(max_batch),
           "--queue-size", str(queue_size), "--model-name", "bench"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    for line in proc.stderr:
        log.append(line)
        if m := re.search(r"serving .* on (http://\S+/v1)", line):
            threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # keep draining
            return proc, m[1], log
    sys.exit("the server exited before serving:\n" + "".join(log))


def rss_kib(pid: int) -> int:
    return next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))


def long_prompt(art: str) -> str:
    """About LONG_TOKENS tokens of repeated text (the chat template adds a few more)."""
    tok = Tokenizer.from_file(str(Path(art) / "tokenizer" / "tokenizer.json"))
    text = " ".join(f"Note {i}: the quick brown fox jumps over the lazy dog by the river." for i in range(400))
    ids = tok.encode(text).ids[:LONG_TOKENS - 40]
    return tok.decode(ids) + "\n\nSummarize the notes above in one sentence."


def read(stream, cut_after: int | None = None) -> tuple[str, str | None, int, int]:
    """(text, finish reason, chunks, prompt tokens) of a streamed chat reply; closed after `cut_after` chunks."""
    text, finish, chunks, prompt_tokens = "", None, 0, 0
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        prompt_tokens = chunk.usage.prompt_tokens if chunk.usage else prompt_tokens
        chunks += 1
        if chunks == cut_after:
            stream.close()  # disconnect mid-stream
            break
    return text, finish, chunks, prompt_tokens


class Load:
    """Shared counters of the load phase (all under one lock)."""

    def __init__(self, client, refs: dict, budget: int, proc):
        self.client, self.refs, self.proc = client, refs, proc
        self.lock, self.budget, self.done = threading.Lock(), budget, 0
        self.ok = self.mismatch = self.lost = self.cut = self.n429 = self.bad429 = 0
        self.problems: list[str] = []
        self.rss: list[tuple[int, int]] = []
        self.outcome: dict[str, bool] = {}  # prompt -> whether its last completed reply equals batch 1

    def ticket(self) -> bool:
        with self.lock:
            self.budget -= 1
            return self.budget >= 0

    def note(self, field: str, problem: str | None = None) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + 1)
            self.done += 1
            if problem and len(self.problems) < 20:
                self.problems.append(problem)
            if self.done % 50 == 0:
                self.rss.append((self.done, rss_kib(self.proc.pid)))

    def request(self, prompt: str, cut_after: int | None = None, max_tokens: int = MAX_TOKENS) -> bool:
        """One streamed request, checked and counted; False when it got 429 (the caller may retry)."""
        try:
            text, finish, chunks, _ = read(self.client.chat.completions.create(
                model="bench", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
                stream=True), cut_after)
            if chunks == cut_after:
                ok = self.refs[prompt][0].startswith(text)
                self.note("cut", None if ok else f"cut reply is not a prefix of its reference: {text!r}")
                return True
        except openai.RateLimitError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            good = "Retry-After" in exc.response.headers and "message" in body and exc.code == "queue_full"
            self.note("n429" if good else "bad429", None if good else f"429 without Retry-After/body: {exc.body!r}")
            return False
        except Exception as exc:  # noqa: BLE001 (a lost request, whatever the reason)
            self.note("lost", f"{type(exc).__name__}: {exc}"[:300])
            return True
        ref_text, ref_finish = self.refs[prompt]
        if finish is None:
            self.note("lost", f"stream ended without a finish reason: {prompt[:40]!r}")
        elif (text, finish) != (ref_text, ref_finish):
            self.note("mismatch", f"{prompt[:40]!r}: got {text[:60]!r} ({finish}), batch 1: {ref_text[:60]!r} ({ref_finish})")
        else:
            self.note("ok")
        self.outcome[prompt] = (text, finish) == (ref_text, ref_finish)
        return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("art")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--queue-size", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()
    prompts = eval_prompts(DEFAULT_EVAL, 2)
    long = long_prompt(args.art)
    proc, url, log = start_server(args.art, args.max_batch, args.queue_size)
    failures: list[str] = []
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        refs, t0 = {}, time.perf_counter()
        for prompt in [*prompts, long]:  # batch 1: one client at a time (this is also the warm-up)
            text, finish, _, long_tokens = read(client.chat.completions.create(
                model="bench", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
                stream=True, stream_options={"include_usage": True}))
            refs[prompt] = (text, finish)
        print(f"reference: {len(refs)} prompts ({len(prompts)} held-out + 1 long of {long_tokens} tokens) at batch 1 "
              f"in {time.perf_counter() - t0:.1f} s")
        load = Load(client, refs, args.requests - BURST - DISCONNECTS - 1, proc)
        rss0 = rss_kib(proc.pid)

        def retrying(prompt: str, **kw) -> None:  # a 429: retry after its Retry-After (1 s)
            while not load.request(prompt, **kw):
                load.ticket()  # (a retry is one more request)
                time.sleep(1.0)

        def looper(i: int) -> None:
            while load.ticket():
                retrying(prompts[i % len(prompts)])
                i += 1

        gate = threading.Barrier(BURST)
        burst = [threading.Thread(target=lambda i=i: (gate.wait(), load.request(prompts[i % len(prompts)])))
                 for i in range(BURST)]
        cutters = [threading.Thread(target=retrying, args=(prompts[i],), kwargs={"cut_after": 3 + i, "max_tokens": 200})
                   for i in range(DISCONNECTS)]
        t0 = time.perf_counter()
        loopers = [threading.Thread(target=looper, args=(i,)) for i in range(args.max_batch)]
        others = [*burst, *cutters, threading.Thread(target=retrying, args=(long,))]
        [t.start() for t in loopers]
        time.sleep(1.0)  # the batch is full now
        [t.start() for t in others]
        [t.join() for t in [*loopers, *others]]
        print(f"load: {load.done} requests in {time.perf_counter() - t0:.1f} s: {load.ok} equal to batch 1, {load.mismatch} different, "
              f"{load.cut} disconnected mid-stream, {load.n429} answered 429 (+{load.bad429} malformed), "
              f"{load.lost} lost")
        print(f"long prompt in the batch: {'equal to batch 1' if load.outcome.get(long) else 'NOT equal or lost'}")
        for problem in load.problems:
            print("  problem:", problem)
        failures += [what for bad, what in ((load.mismatch, "replies differ from batch 1"), (load.lost, "requests lost"),
                                            (load.bad429, "malformed 429s"), (not load.n429, "no 429: the queue never overflowed"),
                                            (not load.outcome.get(long), "the long prompt's reply differs or was lost")) if bad]
        deadline, health = time.time() + 15, None
        while time.time() < deadline:  # idle: what /health says once every stream has ended
            r = requests.get(url.removesuffix("/v1") + "/health", timeout=5)
            health = r.status_code, r.json()
            if r.status_code == 200 and health[1]["streams"] == 0 and health[1]["waiting"] == 0:
                break
            time.sleep(0.2)
        print(f"health once idle: {health}")
        if health is None or health[0] != 200 or health[1]["streams"] or health[1]["waiting"] or proc.poll() is not None:
            failures.append(f"server not healthy and idle afterwards: {health}")
        samples = [(0, rss0), *load.rss, ("idle", rss_kib(proc.pid))]
        print("VmRSS (MiB) after warm-up / every 50 requests / idle: "
              + ", ".join(f"{n}: {kib / 1024:.0f}" for n, kib in samples))
        values = [kib for _, kib in samples]
        if len(values) >= 4 and all(b > a for a, b in itertools.pairwise(values)) and values[-1] > values[0] * 1.1:
            failures.append("resident memory grows steadily")
        if tracebacks := sum("Traceback" in line for line in log):
            failures.append(f"the server logged {tracebacks} traceback(s)")
    finally:
        proc.terminate()
        proc.wait(30)
    print("FAIL: " + "; ".join(failures) if failures else "OK: nothing lost, every reply equals batch 1")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
