"""The prompt files `train-draft` and `bench` read: JSONL, one object a line.

A training file holds either prompts (`{"id", "category", "prompt"}`: the target answers each, and its
responses are the data) or text (`{"id", "category", "text", "source", "license"}`, or token ids
`{"id", "category", "ids", "prompt_len"}`: the target reads them teacher-forced, and its features and
distribution at every position are the data), never both. Text sets widen
the contexts the draft sees beyond the target's own answers (issue 48); `scripts/make_text_set.py`
writes one from files already on a machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.errors import DFlashError

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "models" / "prompts"
# the shipped training prompts: every train*.jsonl (the held-out evaluation set, eval.jsonl, is not one)
DEFAULT_PROMPTS = tuple(sorted(PROMPTS_DIR.glob("train*.jsonl")))


def first_per_category(prompts: list[dict], limit: int | None) -> list[dict]:
    """The first `limit` prompts of each category, categories in order of first appearance (all when
    `limit` is None or 0): the held-out subsets bench and the speculation scripts run."""
    if not limit:
        return list(prompts)
    by_category: dict[str, list[dict]] = {}
    for p in prompts:
        by_category.setdefault(p["category"], []).append(p)
    return [p for rows in by_category.values() for p in rows[:limit]]


def is_text_set(rows: list[dict]) -> bool:
    """Whether rows read by :func:`read_prompts` are a text set (teacher-forced) rather than prompts."""
    return bool(rows) and "prompt" not in rows[0]


def read_prompts(path: Path, allow_text: bool = False) -> list[dict]:
    """Read a JSONL prompt file: one {"id", "category", "prompt"} object a line, or with `allow_text`
    a text set: one {"id", "category", "text"} or {"id", "category", "ids", "prompt_len"} object a line
    (other keys kept).

    Raises:
        DFlashError: missing file, bad JSON, a row that is none of these kinds or several (see
            `_row_kind`), a file mixing kinds, an "id" that is not a string or integer, ends in "#s<N>"
            (reserved for sampled responses) or is used twice in the file.
    """
    path = Path(path)
    if path.is_dir():
        raise DFlashError(f"prompt file {path} is a directory; pass the JSONL files in it")
    if not path.is_file():
        raise DFlashError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DFlashError(f"prompt file {path} is not UTF-8 text") from None
    rows, ids, kind = [], set(), None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashError(f"{path}:{i} is not valid JSON ({exc})") from None
        row_kind = _row_kind(path, i, row, allow_text)
        if kind is not None and row_kind != kind:
            raise DFlashError(f"{path}:{i} is a {row_kind} row in a file of {kind} rows; a file holds prompts (the "
                              "target answers them), text or ids (read teacher-forced), one kind only: split it")
        kind = row_kind
        row.setdefault("id", f"{path.stem}-line-{i}")  # unique across files too (unless two share a stem)
        _check_id(path, i, row["id"], ids)
        ids.add(str(row["id"]))
        row.setdefault("category", "uncategorized")
        rows.append(row)
    if not rows:
        raise DFlashError(f"{path} holds no prompts")
    return rows


def _row_kind(path: Path, line: int, row, allow_text: bool) -> str:
    """"prompt", or where allowed "text" (a string) or "ids" (token ids with a "prompt_len" that leaves
    at least 2 of them to learn from, read teacher-forced as text is).

    Raises:
        DFlashError: the row is none of these, or more than one.
    """
    keys = [k for k in ("prompt", "text", "ids") if isinstance(row, dict) and k in row]
    if len(keys) > 1:
        raise DFlashError(f"{path}:{line} has both {keys[0]!r} and {keys[1]!r}; a row is a prompt (the target answers "
                          "it), a text or token ids (read teacher-forced): keep one")
    if not allow_text and keys and keys[0] != "prompt":
        raise DFlashError(f"{path}:{line} is a text-set row ({keys[0]!r}, for train-draft); this command takes a prompt "
                          "file: rows with a \"prompt\" string")
    kind = keys[0] if keys else None
    if kind in ("prompt", "text") and isinstance(row[kind], str) and row[kind].strip():
        return kind
    if kind == "ids" and _usable_ids(row):
        return kind
    if not allow_text:
        raise DFlashError(f"{path}:{line} has no non-empty \"prompt\" string")
    raise DFlashError(f"{path}:{line} needs a non-empty \"prompt\" or \"text\" string, or \"ids\" (token ids) "
                      "with a \"prompt_len\" (default 1) at least 2 ids before their end")


def _usable_ids(row: dict) -> bool:
    ids, start = row["ids"], row.get("prompt_len", 1)
    return (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids) and type(start) is int
            and 1 <= start <= len(ids) - 2)


def _check_id(path: Path, line: int, row_id, seen: set) -> None:
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise DFlashError(f"{path}:{line}: \"id\" must be a string or an integer (got {row_id!r})")
    if re.search(r"#s\d+$", str(row_id)):
        raise DFlashError(f"{path}:{line}: prompt id {row_id!r} ends like a sampled response's id (<id>#s<N>, "
                          "reserved by --responses-per-prompt); rename it")
    if str(row_id) in seen:
        raise DFlashError(f"{path}:{line}: prompt id {row_id!r} is used twice in this file; ids name the cached "
                          "responses, so each must be unique")


def read_prompt_sets(prompt_files: list[Path], max_prompts: int | None) -> list[list[dict]]:
    """Each file's prompts or text rows (the first `max_prompts`; None: all), refusing an id that two
    files share."""
    prompt_sets = [read_prompts(f, allow_text=True)[:max_prompts] for f in prompt_files]
    seen_ids: dict[str, Path] = {}
    for f, rows in zip(prompt_files, prompt_sets):
        for r in rows:
            if str(r["id"]) in seen_ids:
                why = ("; lines without an \"id\" get <file stem>-line-N, so give the files different names or add ids"
                       if str(r["id"]).startswith(f"{f.stem}-line-") else "")
                raise DFlashError(f"prompt id {r['id']!r} appears in {seen_ids[str(r['id'])]} and again in {f}; "
                                  f"ids must be unique across --prompts files (they name the cached responses){why}")
            seen_ids[str(r["id"])] = f
    return prompt_sets
