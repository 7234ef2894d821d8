"""The one-shot `generate` command, shared by `python -m runtime generate` (torch-free, what a device
runs) and `python -m dflash_export generate` (the same arguments and output).

It prints the reply (text, or ids for an artifact without a tokenizer), then one summary line on
stderr; `--json` prints the whole result as one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from runtime import load
from runtime.errors import DFlashError


def parse_prompt_ids(text: str) -> list[int]:
    """`--prompt-ids`: "1,2,3" -> [1, 2, 3].

    Raises:
        DFlashError: empty, or not comma-separated non-negative integers.
    """
    items = [x.strip() for x in text.split(",")]
    if items == [""]:
        raise DFlashError("--prompt-ids is empty; pass at least one token id")
    if not all(re.fullmatch(r"[0-9]+", x, flags=re.ASCII) for x in items):
        raise DFlashError(f"--prompt-ids must be comma-separated non-negative integers like 1,2,3 (got {text!r})")
    return [int(x) for x in items]


def verify_len_argument(text: str):
    """--verify-len: "auto", "all", an integer or a verify tree "L+A" (ranges are checked by generate)."""
    if text in ("auto", "all") or "+" in text:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be auto, all, an integer or a verify tree "L+A" (got {text!r})') from None


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    """The `generate` subcommand's arguments (on the subparser `g`); its handler is :func:`cmd_generate`."""
    g.add_argument("artifact", help="artifact directory written by build")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    g.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    g.add_argument("--block-size", type=int, default=None, help="default: the draft's; 1 = plain decoding")
    g.add_argument("--verify-len", type=verify_len_argument, default="auto",
                   help="proposals verified per step: auto (default: chosen per step from this device's measured "
                        "costs and the running acceptance, 0 when speculation would not pay), all, 1..block_size-1, or a "
                        "verify tree L+A (L top-1 proposals plus A more candidates for the first position, e.g. 1+3)")
    g.add_argument("--drafter", choices=("auto", "dflash", "mtp"), default="auto",
                   help="where proposals come from: auto (default: the DFlash draft and lookups), dflash, or mtp (the "
                        "target's multi-token-prediction head, artifacts with mtp.onnx; --verify-len chained proposals, 3 by default)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples the target's distribution")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeatable): the reply ends before it")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling random numbers (default 0)")
    g.add_argument("--backend", default="ort", help="ort (onnxruntime CPU), ort-cuda or trt (TensorRT engines)")
    g.add_argument("--int4-accuracy-level", type=int, choices=(1, 4), default=None,
                   help="INT4 artifacts on onnxruntime CPU: 4 = int8 activations (default where the target is "
                        "row-exact: lossless and faster), 1 = fp32 compute")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--steps", action="store_true", help="include each step's proposed and accepted tokens")
    g.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    """Load the artifact, generate once, print the reply. Returns the exit status (0).

    Raises:
        DFlashError: bad arguments, prompt or artifact.
    """

    if args.prompt_ids is not None and args.chat:
        raise DFlashError("--chat applies to --prompt text, not to --prompt-ids")
    prompt = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    if isinstance(prompt, str) and not prompt.strip():
        raise DFlashError("--prompt is empty; pass some text")
    with load(args.artifact, backend=args.backend, int4_accuracy_level=args.int4_accuracy_level) as sess:
        res = sess.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            block_size=args.block_size, chat=args.chat, seed=args.seed, record_steps=args.steps,
                            verify_len=None if args.verify_len == "auto" else args.verify_len,
                            top_p=args.top_p, top_k=args.top_k, stop=args.stop, drafter=args.drafter)
        drafted = "draft" in sess.graphs
        trained = sess.manifest["draft"]["trained"]
    if args.json:
        print(json.dumps(res.to_dict(with_steps=args.steps)))
        return 0
    print(res.text if res.text is not None else res.output_ids)
    steps = len(res.acceptance_lengths)
    lookups = f" ({res.lookup_steps} of {steps} speculative steps were lookups)" if steps else ""
    print(f"\n[{len(res.output_ids)} tokens, finish={res.finish_reason}, tau={res.tau:.2f}{lookups}, "
          f"{res.tokens_per_s:.1f} tok/s, " + (f"draft {'trained' if trained else 'UNTRAINED'}]" if drafted else "no draft]"), file=sys.stderr)
    if args.steps:
        for i, s in enumerate(res.steps):
            source = " (lookup)" if s["lookup"] else ""
            print(f"step {i}: proposed {s['proposed']}{source} accepted {s['accepted']} committed {s['committed']}",
                  file=sys.stderr)
    return 0
