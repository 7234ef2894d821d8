"""Write a text set for `train-draft --prompts`: text files already on a machine (library code,
documentation) cut into rows the target reads teacher-forced.

    python scripts/make_text_set.py --out texts-code.jsonl --category code --license PSF-2.0 \\
        --source-name "CPython 3.11 standard library" /usr/lib/python3.11 --suffix .py --max-rows 1500

Each row is {"id", "category", "text", "source", "license"}: about `--chars` characters cut at line
ends, from the files under the given paths (directories are walked, `--suffix` filters). Rows are a
seeded sample when `--max-rows` is below the chunks found, so a set is reproducible from the same files.
State each source's licence: it is recorded per row, and docs/training.md lists what the project used.

    python scripts/make_text_set.py --from-cache DATA_CACHE --out responses.jsonl

instead writes a `train-draft` data cache's sequences (the target's own responses, prompt included) as
rows of token ids, {"id", "category", "ids", "prompt_len"}: read teacher-forced they give the same
features for other `--taps` at a quarter of what generating them again costs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def fail(message: str):
    """One `error:` line and exit status 2 (bad input), as the project's commands do."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def chunks_of(text: str, chars: int, min_chars: int) -> list[str]:
    """`text` cut at line ends into pieces of about `chars` characters (pieces under `min_chars` dropped)."""
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= chars:
            pieces.append("".join(current))
            current, size = [], 0
    if current:
        pieces.append("".join(current))
    return [p for p in pieces if len(p.strip()) >= min_chars]


def files_under(paths: list[Path], suffixes: list[str]) -> list[Path]:
    """The readable files at or under `paths` with one of `suffixes` (all when empty), sorted."""
    found = set()
    for path in paths:
        if not path.exists():
            fail(f"{path} does not exist")
        for f in ([path] if path.is_file() else path.rglob("*")):
            if f.is_file() and (not suffixes or f.suffix in suffixes):
                found.add(f)
    return sorted(found)


def rows_of_cache(cache: Path) -> list[dict]:
    """A data cache's sequences as id rows (a sampled response's id `<id>#s<k>` becomes `<id>~s<k>`: the
    former is reserved for sampled responses)."""
    path = cache / "sequences.json"
    if not path.is_file():
        fail(f"{path} does not exist: --from-cache takes a finished train-draft data cache")
    try:
        seqs = json.loads(path.read_text())
        rows = [{"id": str(s["id"]).replace("#s", "~s"), "category": str(s.get("category", "uncategorized")),
                 "ids": s["ids"], "prompt_len": max(int(s["prompt_len"]), 1), "source": f"train-draft data cache {cache.name}"}
                for s in seqs]
        if not all(isinstance(r["ids"], list) and all(type(t) is int and t >= 0 for t in r["ids"]) for r in rows):
            raise ValueError("ids that are not token ids")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        fail(f"data cache {cache} is damaged ({type(exc).__name__}: {exc}); pass a finished train-draft data cache")
    return [r for r in rows if len(r["ids"]) - r["prompt_len"] >= 2]


def write_rows(out: Path, rows: list[dict]) -> None:
    """Write the rows whole (a temporary file renamed into place: a kill leaves no partial set)."""
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="files or directories to read")
    ap.add_argument("--from-cache", type=Path, default=None, help="a train-draft data cache to write as id rows")
    ap.add_argument("--out", required=True, type=Path, help="the JSONL text set to write")
    ap.add_argument("--category", help="the rows' category (e.g. code, docs)")
    ap.add_argument("--license", help="the source's licence (e.g. PSF-2.0, BSD-3-Clause)")
    ap.add_argument("--source-name", default=None, help="what the source is, for the record (default: the paths)")
    ap.add_argument("--suffix", action="append", default=[], help="only files ending so (repeatable, e.g. .py)")
    ap.add_argument("--chars", type=int, default=1200, help="about this many characters a row (default %(default)s)")
    ap.add_argument("--min-chars", type=int, default=200, help="drop pieces shorter than this (default %(default)s)")
    ap.add_argument("--max-rows", type=int, default=None, help="a seeded sample of this many rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.out.exists():
        fail(f"{args.out} exists; pass a new --out")
    if not args.out.parent.is_dir():
        fail(f"{args.out.parent} is not a directory; create it or pass another --out")
    if args.from_cache is not None:
        if args.paths:
            fail("--from-cache writes a cache's sequences; give no paths with it")
        rows = rows_of_cache(args.from_cache)
        if not rows:
            fail(f"data cache {args.from_cache} holds no sequence with 2 tokens after its prompt; nothing to write")
        write_rows(args.out, rows)
        print(f"wrote {len(rows)} rows ({sum(len(r['ids']) for r in rows):,} tokens) to {args.out}")
        return 0
    if not (args.paths and args.category and args.license):
        fail("give the paths to read, --category and --license (or --from-cache)")
    if args.max_rows is not None and args.max_rows < 1:
        fail(f"--max-rows {args.max_rows}: give at least 1 (or leave it out for every row)")
    if args.chars < 1 or args.min_chars > args.chars:
        fail(f"--chars {args.chars} with --min-chars {args.min_chars}: rows need --chars >= 1 and >= --min-chars")
    source = args.source_name or " ".join(str(p) for p in args.paths)
    rows = []
    for f in files_under(args.paths, args.suffix):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not text
        if "\x00" in text:
            continue  # valid UTF-8, yet binary
        for j, piece in enumerate(chunks_of(text, args.chars, args.min_chars)):
            rows.append({"id": f"{args.category}:{f}:{j}", "category": args.category, "text": piece,
                         "source": source, "license": args.license})
    if not rows:
        fail(f"no text of at least --min-chars {args.min_chars} characters under the given paths (check --suffix)")
    if args.max_rows and args.max_rows < len(rows):
        rows = random.Random(args.seed).sample(rows, args.max_rows)
    write_rows(args.out, rows)
    print(f"wrote {len(rows)} rows ({sum(len(r['text']) for r in rows):,} characters) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
