"""`python -m runtime serve DIR ...` (OpenAI-compatible server), `python -m runtime chat DIR ...` and
`python -m runtime generate DIR --prompt ...` (one reply; the same command as `python -m dflash_export
generate`, without torch).

User errors (a bad artifact directory, a missing server library, an address in use) print one
`error:` line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys

from runtime.batching.engine import DEFAULT_MAX_BATCH
from runtime.cli.generate import add_generate_arguments
from runtime.errors import DFlashError
from runtime.manifest import BATCHED_GRAPH, load_manifest

API_KEY_ENV = "DFLASH_EXPORT_API_KEY"  # the key without putting it on the command line (visible in ps)
BACKENDS = ("ort", "ort-cuda", "trt")  # (runtime.backends.select.BACKEND_NAMES)
# the serve extra and what it pulls in: a missing one is answered with the pip command
SERVER_LIBRARIES = ("starlette", "uvicorn", "anyio", "h11", "click")


def build_parser() -> argparse.ArgumentParser:
    """The command line: `serve`, `chat` and `generate` subcommands."""
    p = argparse.ArgumentParser(prog="python -m runtime", description="Serve, chat with or generate from a dflash_export artifact.")
    sub = p.add_subparsers(dest="command", metavar="{serve,chat,generate}")
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra: pip install '.[serve]' from the project)")
    s.add_argument("dir", help="artifact directory (from `python -m dflash_export build`)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on /v1 requests (default: ${API_KEY_ENV}, else none)")
    s.add_argument("--backend", choices=BACKENDS, default="ort")
    s.add_argument("--queue-size", type=int, default=16, help="requests that may wait for a slot (default: 16)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="generations decoded at once (needs an artifact built with --batched; default: "
                        f"{DEFAULT_MAX_BATCH} for such artifacts, else 1: one at a time, with speculative decoding)")
    s.add_argument("--no-lone-graph", dest="lone_graph", action="store_false", default=None,
                   help="with --max-batch > 1 on the CPU: do not load the one-sequence target graph beside the batched one "
                        "(saves its weights' memory; a lone client then decodes about 10%% slower)")
    s.add_argument("--model-name", help="the model id clients use (default: the target's name; for a local checkpoint, the artifact directory's)")
    s.add_argument("--max-connections", type=int, default=64,
                   help="open connections beyond this get 503 at once (default: 64; see the README's Serving limits)")
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal, streamed")
    c.add_argument("dir", help="artifact directory")
    c.add_argument("--backend", choices=BACKENDS, default="ort")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--max-tokens", type=int, help="reply length limit (default: what fits, at most 512)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--seed", type=int, default=0, help="sampling seed of the first reply; reply k uses seed + k (default 0)")
    c.add_argument("--verify-len", default=None, help='"auto" (default), "all" or an integer: proposals verified per step')
    c.set_defaults(func=cmd_chat)
    add_generate_arguments(sub.add_parser("generate", help="generate one reply (speculative decoding) and print it"))
    return p


def cmd_serve(args) -> int:
    """Load the artifact and serve it until Ctrl-C."""
    if not 0 <= args.port <= 65535:
        raise DFlashError(f"--port must be between 0 and 65535 (got {args.port})")
    if args.queue_size < 1:
        raise DFlashError(f"--queue-size must be at least 1 (got {args.queue_size})")
    if args.api_key is not None:
        args.api_key = check_api_key(args.api_key)

    try:
        from runtime.serve.app import create_app
        from runtime.serve.run import listen_socket, uvicorn_server
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in SERVER_LIBRARIES:
            raise
        raise DFlashError(f"the server needs {exc.name}, which is not installed: pip install '.[serve]' (the serve extra, from the dflash_export project directory)") from None
    manifest = load_manifest(args.dir)  # the cheap checks first: a bad directory, then an address in use
    max_batch = _max_batch(args, manifest)
    if args.max_connections < max_batch + args.queue_size + 1:
        need = max_batch + args.queue_size + 1
        raise DFlashError(f"--max-connections must be at least --max-batch + --queue-size + 1 = {need} (the running "
                          f"requests, the waiting ones and a /health probe; got {args.max_connections})")
    sock = listen_socket(args.host, args.port)
    with contextlib.closing(sock), _load_for_serving(args, max_batch) as sess:
        app = create_app(sess, model_name=args.model_name, api_key=args.api_key, queue_size=args.queue_size)
        _warm_up(sess)
        host, port = sock.getsockname()[:2]
        api = app.state.api
        how = "one generation at a time" if max_batch == 1 else f"up to {max_batch} generations at once"
        print(f"serving {api.model_name!r} on http://{_url_host(host)}:{port}/v1 ({args.backend}, max_seq_len "
              f"{sess.max_seq_len}, {how}, queue {args.queue_size})", file=sys.stderr, flush=True)
        if args.api_key is None and not _is_loopback(args.host):
            print(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
                  file=sys.stderr)
        uvicorn_server(app, max_connections=args.max_connections).run(sockets=[sock])
    return 0


def _max_batch(args, manifest: dict) -> int:
    """--max-batch, checked against the artifact (default: batched where the artifact can; with TensorRT,
    the batched engine's slots)."""
    batched = BATCHED_GRAPH in manifest
    engines = (manifest.get("trt") or {}).get("max_batch") if args.backend == "trt" else None
    default = (engines or DEFAULT_MAX_BATCH) if batched and (args.backend != "trt" or engines) else 1
    n = args.max_batch if args.max_batch is not None else default
    if n < 1:
        raise DFlashError(f"--max-batch must be at least 1 (got {n})")
    if n > 1 and not batched:
        raise DFlashError(f"--max-batch {n} needs an artifact built with `python -m dflash_export build --batched`; "
                          f"{args.dir} has no batched graph (serve it with --max-batch 1, or rebuild it)")
    return n


def _load_for_serving(args, max_batch: int):
    import runtime

    if max_batch == 1:
        return runtime.load(args.dir, backend=args.backend)
    from runtime.batching import BatchEngine

    return BatchEngine(args.dir, max_batch=max_batch, backend=args.backend, lone_graph=getattr(args, "lone_graph", None))


def check_api_key(key: str) -> str:
    """The key with surrounding whitespace removed (a trailing newline from a file or an environment
    variable would lock every client out: no header can carry it).

    Raises:
        DFlashError: an empty key, or one that is not printable ASCII without spaces (what an HTTP
        header carries the same way in every client: `Authorization: Bearer <key>`).
    """
    key = key.strip()
    if not key:
        raise DFlashError("--api-key is empty")
    if not all("!" <= ch <= "~" for ch in key):
        raise DFlashError("--api-key must be printable ASCII without spaces (HTTP clients send it in the "
                          "Authorization header; other characters are encoded differently by each client)")
    return key


def _warm_up(sess) -> None:
    """One short generation, so the first request does not pay for the step-cost measurement
    (`--verify-len auto` measures it once per device and caches it) or the graphs' first run."""
    ids = sess.encode("Hello")
    if hasattr(sess, "reset"):
        sess.generate(ids, max_new_tokens=2, stop_token_ids=[])
        sess.reset()
    else:  # a BatchEngine
        sess.generate([ids], max_new_tokens=2, stop_token_ids=[], reuse_prefix=False)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def cmd_chat(args) -> int:
    """Load the artifact and chat on stdin/stdout."""
    import runtime
    from runtime.cli.chat import run_chat
    from runtime.options import GenerationOptions

    verify_len = args.verify_len
    if verify_len is not None and verify_len.lstrip("-").isdigit():
        verify_len = int(verify_len)
    options = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                   verify_len=verify_len)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise DFlashError(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    GenerationOptions(**options)  # bad values fail before the model loads
    with runtime.load(args.dir, backend=args.backend) as sess:
        return run_chat(sess, system=args.system, max_tokens=args.max_tokens, **options)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 usage or user error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
