"""Constrained decoding speed: JSON-schema replies with the default policy against constrained plain
decoding (`block_size` 1) on one artifact, in alternating order, and the grammar mask's cost per token.

    python scripts/constrained_bench.py ARTIFACT [--rounds 3] [--max-new-tokens 96] [--threads N] [--tools]

--tools asks for tool calls instead (`tool_choice: "required"`, one call, the schemas as the
functions' parameters).

    PEER_PYTHON scripts/constrained_bench.py --llama GGUF [--rounds 3] [--max-new-tokens 96]

runs the same schema requests through llama.cpp (llama-cpp-python's `create_chat_completion` with
`response_format: {"type": "json_object", "schema": ...}`, its GBNF grammar), greedy, in a Python
that has llama-cpp-python (it needs neither this package nor torch), and prints tok/s (completion
tokens over wall time, prompt included) and validity per prompt, for a side-by-side table with
`--wall` runs of ours.

Prints, per prompt, the median tok/s of each mode over the rounds and their ratio, the median ratio,
whether every pair of replies was equal (they must be) and valid JSON for the schema, and the mask
cost per masked row against a plain step's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# four schemas of the kinds applications send: a record, a tool-call-like object, a list, an enum
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
     "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}},
    {"type": "object", "additionalProperties": False, "required": ["function", "arguments"],
     "properties": {"function": {"enum": ["get_weather", "search", "set_timer"]},
                    "arguments": {"type": "object", "additionalProperties": False, "required": ["query"],
                                  "properties": {"query": {"type": "string"}}}}},
    {"type": "object", "additionalProperties": False, "required": ["items"],
     "properties": {"items": {"type": "array", "maxItems": 5, "items": {"type": "string"}}}},
    {"type": "object", "additionalProperties": False, "required": ["sentiment", "confidence"],
     "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number"}}},
]
PROMPTS = [
    "Extract the person: Maria Lopez is 41 and lives in Valencia. Answer in JSON.",
    "Call a tool to find the weather in Oslo tomorrow. Answer in JSON.",
    "List five things to pack for a beach trip, as JSON.",
    "Classify the sentiment of: 'The battery died after an hour, very disappointing.' Answer in JSON.",
    "Extract the person: Chen Wei, 29, from Chengdu. Answer in JSON.",
    "Call a tool to set a timer for 10 minutes. Answer in JSON.",
    "List the planets closest to the sun, as JSON.",
    "Classify the sentiment of: 'Best concert I have been to in years!' Answer in JSON.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tools", action="store_true", help="forced tool calls instead of response_format")
    ap.add_argument("--llama", metavar="GGUF", help="run the requests through llama.cpp instead (no ARTIFACT)")
    ap.add_argument("--wall", action="store_true", help="ours: default decoding's tok/s over wall time per request, "
                                                         "as --llama reports it")
    args = ap.parse_args()
    if args.llama or args.wall:
        return wall_rates(args)
    import runtime

    sess = runtime.load(args.artifact, threads=args.threads)
    ratios, equal, valid, finished = [], True, 0, 0
    mask_s = masks = 0
    plain_step = []
    for i, prompt in enumerate(PROMPTS):
        schema = SCHEMAS[i % len(SCHEMAS)]
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        ask = dict(response_format=fmt)
        if args.tools:
            ask = dict(tools=[{"type": "function", "function": {"name": f"tool_{j}", "parameters": sch}}
                              for j, sch in enumerate(SCHEMAS)], tool_choice=f"tool_{i % len(SCHEMAS)}")
        msgs = [{"role": "user", "content": prompt}]
        speeds: dict[str, list[float]] = {"plain": [], "default": []}
        outs = {}
        for r in range(args.rounds):
            for mode in (("plain", "default") if r % 2 == 0 else ("default", "plain")):
                kw = dict(block_size=1) if mode == "plain" else {}
                t0 = time.perf_counter()
                res = sess.chat(msgs, max_new_tokens=args.max_new_tokens, **ask, **kw)
                speeds[mode].append(len(res.output_ids) / (time.perf_counter() - t0))
                outs.setdefault(mode, res.output_ids)
                if mode == "default" and r == 0:
                    finished += res.finish_reason in ("stop", "tool_calls")
                    last = res
                equal &= outs[mode] == res.output_ids
                if mode == "plain":
                    plain_step.append(res.verify_s / max(len(res.output_ids) - 1, 1))
        equal &= outs["plain"] == outs["default"]
        text = sess.tokenizer.decode(outs["default"])
        try:
            json.loads(last.tool_calls[0]["function"]["arguments"] if args.tools else text)
            valid += 1
        except (ValueError, IndexError):
            pass
        p, d = statistics.median(speeds["plain"]), statistics.median(speeds["default"])
        ratios.append(d / p)
        print(f"prompt {i}: plain {p:6.1f} tok/s  default {d:6.1f} tok/s  {d / p:5.2f}x  {text[:60]!r}")
    # the mask's own cost: one constrained request's matcher, timed row by row
    from runtime.options import GenerationOptions

    constraint = sess.constraint(GenerationOptions(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMAS[0]}}))
    reply = sess.chat([{"role": "user", "content": PROMPTS[0]}], max_new_tokens=args.max_new_tokens,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}})
    for t in reply.output_ids:
        if constraint.finished:
            break
        constraint.allowed()
        constraint.commit(t)
    mask_s, masks = constraint.mask_seconds, constraint.masks
    per_mask = mask_s / max(masks, 1)
    step = statistics.median(plain_step)
    print(f"median default/plain: {statistics.median(ratios):.2f}x over {len(ratios)} prompts x {args.rounds} rounds; "
          f"replies equal: {equal}; finished within --max-new-tokens: {finished}/{len(PROMPTS)}, valid JSON: "
          f"{valid}/{len(PROMPTS)} (a reply cut by the token limit stops inside a value)")
    print(f"mask: {per_mask * 1e3:.3f} ms per row (vocabulary {sess.manifest['target']['vocab_size']}), "
          f"{per_mask / step:.1%} of a plain step's target call ({step * 1e3:.1f} ms)")


def wall_rates(args) -> None:
    """Per prompt: the median over rounds of completion tokens / wall seconds of one schema request
    (greedy, chat), and whether the reply parses with the schema's required keys; through llama.cpp
    (`--llama GGUF`) or our default decoding (`--wall ARTIFACT`)."""
    if args.llama:
        from llama_cpp import Llama

        llm = Llama(model_path=args.llama, n_ctx=2048, n_threads=args.threads or 2, verbose=False, seed=0)

        def ask(messages, schema):
            r = llm.create_chat_completion(messages=messages, temperature=0.0, max_tokens=args.max_new_tokens,
                                           response_format={"type": "json_object", "schema": schema})
            return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]
    else:
        import runtime

        sess = runtime.load(args.artifact, threads=args.threads)

        def ask(messages, schema):
            r = sess.chat(messages, max_new_tokens=args.max_new_tokens, response_format={
                "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            return r.text, len(r.output_ids)
    rates, valid = [], 0
    for i, prompt in enumerate(PROMPTS):
        schema = SCHEMAS[i % len(SCHEMAS)]
        runs = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            text, n = ask([{"role": "user", "content": prompt}], schema)
            runs.append(n / (time.perf_counter() - t0))
        try:
            ok = all(k in json.loads(text) for k in schema["required"])
        except (ValueError, TypeError):
            ok = False
        valid += ok
        rates.append(statistics.median(runs))
        print(f"prompt {i}: {rates[-1]:6.1f} tok/s  {'valid' if ok else 'INVALID'}  {text[:60]!r}")
    print(f"median {statistics.median(rates):.1f} tok/s over {len(PROMPTS)} prompts x {args.rounds} rounds; "
          f"valid with the required keys: {valid}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
