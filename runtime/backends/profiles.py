"""The shapes the decoding loop binds, as TensorRT optimization profiles: ONE source for both.

`shape_ranges(manifest)` gives, for each graph, a short list of :class:`Profile`\\ s. A profile
fixes a (min, opt, max) range for every symbolic dimension of the exported graph (the
`torch.export.Dim` names recorded in `manifest["io"]`), and from them a (min, opt, max) shape
for every input. The engine builder (`dflash_export.trt.engine`) turns them into TensorRT
optimization profiles; the TensorRT backend picks, per call, the first profile that covers the
call's shapes (:func:`select_profile`); the tests record every shape the onnxruntime session
really binds in `generate` and check that each call lies inside one profile.

Why several profiles per graph: the loop never runs a long prompt on top of a long past, but
one profile is a box (every input ranges independently), and TensorRT sizes activation memory
for the box's corner. Splitting prefill (T up to max_seq_len - 1, no past) from verify (T = 1,
N < max_block, any past) keeps the attention scratch at O(S * S) instead of O(S * 2S).

Zero-length dimensions: prefill binds an empty past (P = 0) and no proposals (N = 0); plain
decoding verifies with N = 0; the first draft call has an empty context cache (Pc = 0). These
need profiles whose min is 0 (see docs/jetson.md for the TensorRT risk and the fallback).

Hybrid targets (Qwen3.5: Gated DeltaNet layers, `runtime/recurrent.py`): besides the attention
layers' past K/V (named by the model's layer index, so not necessarily `past_key_0`), each GDN layer
has static-shape state inputs (`conv_state_i`, fp32 `recurrent_state_i`: min = opt = max, as
exported) and pending-row inputs `pending_{qkv,a,b}_i` whose rows R ("pending_rows") are the
previous call's committed rows: R = 0 whenever P = 0 (prefill on an empty context; the same
zero-length handling as the past K/V there), and 0 <= R <= max_call_rows otherwise (0 after a reused
prefix is cut back to the folded state). One call takes T + N <= `manifest["target"]["max_call_rows"]`
rows (64), and every profile's box keeps that at its corner: prefill and extend have N = 0 and
T <= max_call_rows, verify has T = 1 and N <= max_call_rows - 1. These profiles are written against
TensorRT's documented behaviour and were run only through the test double
(tests/test_trt_backend_double.py, tests/test_trt_hybrid_double.py), never on TensorRT.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from runtime.errors import DFlashError
from runtime.manifest import (
    BATCHED_DRAFT_GRAPH,
    BATCHED_GRAPH,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    has_batched_draft,
    has_draft,
    has_mtp,
    is_hybrid,
)

# Symbolic dims of the exported graphs (dflash_export/export.py; a hybrid target adds "pending_rows",
# dflash_export/families/qwen3_5.export_inputs).
TARGET_DIMS = ("new_tokens", "proposals", "past_len", "sampled_rows")
DRAFT_DIMS = ("context_len", "block_size", "past_context_len", "draft_rows")

Range = tuple[int, int, int]
# Most prompt rows one target call prefills on top of a cached prefix (KV reuse), and most context
# rows one draft call reads on top of its cache (catching up after plain steps): longer runs are
# split into calls of this many rows, so these profiles' attention scratch stays O(E * S).
EXTEND_ROWS = 256
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """One optimization profile of a graph.

    Attributes:
        name: what the loop uses it for ("prefill", "verify", "draft_prefill", "draft_step").
        dims: (min, opt, max) per symbolic dimension.
        shapes: (min, opt, max) shape per input name, in graph input order.
    """

    name: str
    dims: dict[str, Range]
    shapes: dict[str, tuple[Shape, Shape, Shape]] = field(default_factory=dict)

    def covers(self, shapes: dict[str, Shape]) -> bool:
        """Whether every given input shape lies inside this profile (names must all be known)."""
        for name, shape in shapes.items():
            rng = self.shapes.get(name)
            if rng is None or len(rng[0]) != len(shape):
                return False
            lo, _, hi = rng
            if any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
                return False
        return True

    def to_json(self) -> dict:
        """JSON-ready form (as recorded in `manifest["trt"]["profiles"]`)."""
        return {
            "name": self.name,
            "dims": {k: list(v) for k, v in self.dims.items()},
            "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        return cls(
            name=data["name"],
            dims={k: tuple(v) for k, v in data["dims"].items()},
            shapes={k: tuple(tuple(s) for s in v) for k, v in data["shapes"].items()},
        )


def max_block(manifest: dict) -> int:
    """Block capacity of a session's scratch buffers (the same rule as `Session._allocate`)."""

    return max(MAX_BLOCK_SIZE, int(manifest["draft"]["block_size"]))


def _clamp(lo: int, opt: int, hi: int) -> Range:
    hi = max(lo, hi)
    return (lo, min(max(opt, lo), hi), hi)


def dim_ranges(manifest: dict, max_block_size: int | None = None) -> dict[str, list[tuple[str, dict[str, Range]]]]:
    """(min, opt, max) of every symbolic dimension, per profile, from the loop's rules.

    With S = max_seq_len, mb = max_block, b = the draft's block size:

    - target "prefill": T in [1, S-1] (a prompt leaves room for >= 1 new token), N = 0, P = 0.
    - target "verify": T = 1 (the last committed token), N in [0, mb-1] (N = 0 in plain decoding and
      on the last step), P in [1, S-1] (the committed length; P + 1 + N <= S).
    - sampled rows U (uniform's length, graphs exported since draft_vocab support): 0 when greedy, 1 + N
      when sampling (1 at prefill). Older graphs tie uniform to "proposals + 1" and ignore this range.
    - draft "draft_prefill": the first draft call, C = prompt length in [1, S-1], B in [2, mb], Pc = 0.
    - target "extend": a prompt's new rows on a reused prefix, T in [1, E], N = 0, P in [1, S-1]
      (E = EXTEND_ROWS; the loop splits longer runs, see :func:`call_row_limit`).
    - draft "draft_step": C = accepted + 1 (or, catching up after plain steps or on a reused prompt,
      up to E rows) in [1, max(mb, E)], B in [2, mb], Pc in [1, S-1].
    - both draft profiles: R (`proposal_rows`, the rows returned: hidden rows or candidate rows) in
      [1, mb-1], opt b-1.

    Hybrid targets (`manifest["target"]["max_call_rows"]` = R_max, 64): prefill and extend take
    T <= R_max, verify N <= R_max - 1 and U <= R_max (so T + N <= R_max at every profile corner), and
    the pending rows R ("pending_rows") are (0, 0, 0) at prefill (P = 0) and in [0, R_max] for verify
    (opt b // 2: a typical accepted prefix) and extend (opt R_max: the chunks of a long prompt).
    """
    S = int(manifest["max_seq_len"])
    mb = int(max_block_size or max_block(manifest))
    b = int(manifest["draft"]["block_size"])
    top = max(1, S - 1)
    ext = min(top, EXTEND_ROWS)
    hybrid = is_hybrid(manifest)
    call_rows = manifest["target"].get("max_call_rows")
    t_top, t_ext, t_mb = top, ext, mb  # the target's rows per call (T, and N + 1) under a row bound
    if call_rows:
        r = int(call_rows)
        t_top, t_ext, t_mb = min(top, r), min(ext, r), min(mb, r)
    target = [
        ("prefill", {"new_tokens": _clamp(1, min(t_top, 256), t_top), "proposals": (0, 0, 0), "past_len": (0, 0, 0),
                     "sampled_rows": (0, 0, 1)}),
        ("verify", {"new_tokens": (1, 1, 1), "proposals": _clamp(0, b - 1, t_mb - 1), "past_len": _clamp(1, S // 2, top),
                    "sampled_rows": _clamp(0, 0, t_mb)}),
        ("extend", {"new_tokens": _clamp(1, t_ext, t_ext), "proposals": (0, 0, 0), "past_len": _clamp(1, S // 2, top),
                    "sampled_rows": (0, 0, 1)}),
    ]
    if hybrid:
        if not call_rows:
            raise DFlashError("the manifest's hybrid target has no max_call_rows; rebuild the artifact")
        r = int(call_rows)
        pending = {"prefill": (0, 0, 0), "verify": _clamp(0, max(1, b // 2), r), "extend": _clamp(0, r, r)}
        target = [(name, {**dims, "pending_rows": pending[name]}) for name, dims in target]
    rows = _clamp(1, b - 1, mb - 1)  # rows returned (graphs with `proposal_rows`)
    return {
        "target": target,
        "draft": [
            ("draft_prefill", {"context_len": _clamp(1, min(top, 256), top), "block_size": _clamp(2, b, mb),
                               "past_context_len": (0, 0, 0), "draft_rows": rows}),
            ("draft_step", {"context_len": _clamp(1, max(1, b // 2), max(mb, ext)), "block_size": _clamp(2, b, mb),
                            "past_context_len": _clamp(1, S // 2, top), "draft_rows": rows}),
        ],
    }


def batched_dim_ranges(manifest: dict, max_batch: int = DEFAULT_MAX_BATCH,
                       prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[tuple[str, dict[str, Range]]]:
    """(min, opt, max) of the batched target graph's dimensions (`runtime.batching`), S = max_seq_len:

    - "batched_decode": B in [1, max_batch] sequences of T in [1, block] rows (the last committed token
      and up to block - 1 proposals: a verify step; block = the draft's block size),
      L = keys in [1, S + block], K logits rows and U sampled rows in [1, max_batch * block];
    - "batched_prefill": B in [1, max_batch] prompt chunks of T in [1, prefill_chunk] rows (the engine
      sizes its activations for B * T = max_batch * prefill_chunk), L in [1, S + prefill_chunk], K and U
      up to max_batch;
    - both: the caches' rows fixed at S * max_batch (one slot per sequence: an engine serves exactly
      `max_batch` slots); a hybrid's GDN states fixed at max_batch slots, its pending-row buffers at
      max_batch x R rows, and P pending rows per sequence in [1, R] (R = max_call_rows, which also caps
      a prefill chunk's rows per sequence).
    """
    S, mb, chunk = int(manifest["max_seq_len"]), int(max_batch), int(prefill_chunk)
    block = max(int(manifest["draft"]["block_size"]), 2)
    cache = {"cache_rows": (S * mb, S * mb, S * mb)}
    limit = manifest["target"].get("max_call_rows")
    if limit is not None:  # a hybrid (`nn.batched_hybrid`)
        r = int(limit)
        chunk = min(chunk, r)
        cache.update(state_slots=(mb, mb, mb), pending_buffer=(mb * r, mb * r, mb * r), pending_rows=(1, 1, r))
    return [
        ("batched_decode", {"batch": _clamp(1, mb, mb), "rows_per_sequence": _clamp(1, 1, block),
                            "keys": _clamp(1, S // 2, S + block), "logit_rows": _clamp(1, mb, mb * block),
                            "sampled_rows": (0, 0, mb * block), **cache}),
        ("batched_prefill", {"batch": _clamp(1, 1, mb), "rows_per_sequence": _clamp(1, chunk, chunk),
                             "keys": _clamp(1, chunk, S + chunk), "logit_rows": _clamp(1, mb, mb),
                             "sampled_rows": (0, 0, mb), **cache}),
    ]


def mtp_dim_ranges(manifest: dict) -> list[tuple[str, dict[str, Range]]]:
    """(min, opt, max) of the MTP head's graph (`runtime.graphs.calls.GraphCalls.mtp_propose`), S =
    max_seq_len: E new entries in [1, 64] (a prompt is entered in calls of 64; a step enters the
    accepted rows, then one chained entry at a time: opt 1) after P cached entries in [0, S - 1]."""
    S = int(manifest["max_seq_len"])
    return [("mtp", {"new_entries": _clamp(1, 1, 64), "past_entries": _clamp(0, S // 2, max(S - 1, 0))})]


def draft_pending_rows(manifest: dict, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
    """Tap rows a batched engine's slot keeps for its draft before the draft must read them: one
    prefill chunk and two blocks (`runtime.batching.drafts`)."""
    return int(prefill_chunk) + 2 * int(manifest["draft"]["block_size"])


def batched_draft_dim_ranges(manifest: dict, max_batch: int = DEFAULT_MAX_BATCH,
                             prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[tuple[str, dict[str, Range]]]:
    """(min, opt, max) of the batched draft graph's dimensions (`nn.batched_draft`), S = max_seq_len,
    P = :func:`draft_pending_rows`: B in [1, max_batch] sequences, each with up to P new context rows
    (C keys, Ctot packed rows up to max_batch x P) and up to S cached ones, blocks of 2 to the block
    capacity, R proposal rows; the tap buffer fixed at max_batch x P rows, the caches at S x max_batch."""
    S, mb, block = int(manifest["max_seq_len"]), int(max_batch), max(int(manifest["draft"]["block_size"]), 2)
    pending, blocks = draft_pending_rows(manifest, prefill_chunk), max_block(manifest)
    return [("batched_draft", {
        "batch": _clamp(1, mb, mb), "tap_rows": (mb * pending,) * 3, "context_rows": _clamp(1, 2 * mb, mb * pending),
        "context_keys": _clamp(1, 2, pending), "past_keys": _clamp(1, S // 2, S), "block_size": _clamp(2, block, blocks),
        "draft_rows": _clamp(1, block - 1, blocks - 1), "cache_rows": (S * mb,) * 3})]


def shape_ranges(manifest: dict, max_block_size: int | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict[str, list[Profile]]:
    """Optimization profiles of every graph: {"target": [...], "draft": [...]}, and "target_batched" and
    "draft_batched" where the artifact has them (:func:`batched_dim_ranges`,
    :func:`batched_draft_dim_ranges`, for `max_batch` slots).

    Input shapes come from the graph IO recorded in the manifest (`manifest["io"]`): static dims
    as exported, symbolic dims (and expressions such as "proposals + 1") from :func:`dim_ranges`.

    Raises:
        DFlashError: the manifest lacks graph IO or uses a dimension this runtime does not know.
    """
    io = manifest.get("io")
    if not io or "target" not in io or ("draft" not in io and has_draft(manifest)):
        raise DFlashError("the manifest has no graph IO description ('io'); rebuild the artifact")
    out: dict[str, list[Profile]] = {}
    ranges = dim_ranges(manifest, max_block_size)
    if not has_draft(manifest):  # (`build --draft none`)
        del ranges["draft"]
    if BATCHED_GRAPH in manifest and BATCHED_GRAPH in io:
        ranges[BATCHED_GRAPH] = batched_dim_ranges(manifest, max_batch, prefill_chunk)
    if has_batched_draft(manifest):
        ranges[BATCHED_DRAFT_GRAPH] = batched_draft_dim_ranges(manifest, max_batch, prefill_chunk)
    if has_mtp(manifest) and "mtp" in io:
        ranges["mtp"] = mtp_dim_ranges(manifest)
    for graph, profiles in ranges.items():
        out[graph] = []
        for name, dims in profiles:
            shapes = {}
            for spec in io[graph]["inputs"]:
                shapes[spec["name"]] = tuple(
                    tuple(_eval_dim(d, {k: v[i] for k, v in dims.items()}, graph, spec["name"]) for d in spec["shape"])
                    for i in range(3)
                )
            out[graph].append(Profile(name, dims, shapes))
    return out


def select_profile(profiles: list[Profile], shapes: dict[str, Shape], graph: str = "graph") -> int:
    """Index of the first profile covering all `shapes`.

    Raises:
        DFlashError: no profile covers them (a shape the engines were not built for).
    """
    for i, prof in enumerate(profiles):
        if prof.covers(shapes):
            return i
    per_layer = ("past_key_", "past_value_", "conv_state_", "recurrent_state_", "pending_")
    desc = ", ".join(f"{k}{list(v)}" for k, v in shapes.items() if not k.startswith(per_layer))
    past = next((v for k, v in shapes.items() if k.startswith("past_")), None)
    pending = next((v for k, v in shapes.items() if k.startswith("pending_qkv_")), None)
    raise DFlashError(
        f"the {graph} engine has no optimization profile for shapes {desc}"
        + (f", past {list(past)}" if past is not None else "")
        + (f", pending rows {list(pending)}" if pending is not None else "")
        + f" (profiles: {[p.name for p in profiles]}). The engines cover prompts up to max_seq_len - 1 and blocks "
        "up to their max block: use a smaller block, or rebuild the engines (`python -m dflash_export engine DIR "
        "--max-block N`, or `build --max-seq-len N` for longer requests)"
    )


def call_row_limit(profiles: list[Profile], graph: str) -> int:
    """The most new rows one call on top of a non-empty cache may take under these profiles: prompt
    rows for the target ("extend"; 1 with engines built before it: their "verify" takes T = 1), context
    rows for the draft ("draft_step")."""
    rows = "input_ids" if graph == "target" else "context_hidden"
    limits = []
    for p in profiles:  # a hybrid target's first attention layer need not be layer 0
        past = next((n for n in p.shapes if n.startswith("past_key_")), None)
        if rows in p.shapes and past is not None and p.shapes[past][2][0] >= 1:
            limits.append(p.shapes[rows][2][0])
    return max(limits, default=1)


def output_shapes(manifest: dict, graph: str, input_shapes: dict[str, Shape]) -> dict[str, Shape]:
    """Output shapes of `graph` for the given input shapes, from the symbolic IO in the manifest.

    Raises:
        DFlashError: an input shape contradicts the graph's static dims or another input.
    """
    io = manifest["io"][graph]
    env: dict[str, int] = {}
    for spec in io["inputs"]:
        shape = input_shapes.get(spec["name"])
        if shape is None:
            continue
        if len(shape) != len(spec["shape"]):
            raise DFlashError(f"{graph} input {spec['name']}: rank {len(shape)} != {len(spec['shape'])}")
        for d, s in zip(spec["shape"], shape):
            if isinstance(d, str) and d.isidentifier():
                if env.setdefault(d, int(s)) != int(s):
                    raise DFlashError(f"{graph} input {spec['name']}: dim {d} is {s} here but {env[d]} elsewhere")
    for spec in io["inputs"]:  # now check the static dims and the expressions
        shape = input_shapes.get(spec["name"])
        if shape is None:
            continue
        want = tuple(_eval_dim(d, env, graph, spec["name"]) for d in spec["shape"])
        if want != tuple(int(s) for s in shape):
            raise DFlashError(f"{graph} input {spec['name']}: shape {list(shape)} does not match {spec['shape']} = {list(want)}")
    return {spec["name"]: tuple(_eval_dim(d, env, graph, spec["name"]) for d in spec["shape"]) for spec in io["outputs"]}


_ALLOWED_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                ast.FloorDiv: lambda a, b: a // b}


def _eval_dim(dim, env: dict[str, int], graph: str, tensor: str) -> int:
    """A dim from the manifest IO: an int, a symbol, or a +,-,*,// expression of symbols."""
    if isinstance(dim, int):
        return dim

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise DFlashError(
                    f"{graph} tensor {tensor}: unknown dimension {node.id!r} (this runtime knows "
                    f"{sorted(env)}); rebuild the artifact with the matching dflash_export"
                )
            return env[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_OPS:
            return _ALLOWED_OPS[type(node.op)](ev(node.left), ev(node.right))
        raise DFlashError(f"{graph} tensor {tensor}: cannot read dimension {dim!r}; rebuild the artifact")

    try:
        tree = ast.parse(str(dim), mode="eval")
    except SyntaxError:
        raise DFlashError(f"{graph} tensor {tensor}: cannot read dimension {dim!r}; rebuild the artifact") from None
    return int(ev(tree))


def profiles_to_json(ranges: dict[str, list[Profile]]) -> dict:
    """`shape_ranges` output in the JSON form stored in the manifest."""
    return {g: [p.to_json() for p in ps] for g, ps in ranges.items()}


def profiles_from_json(data: dict) -> dict[str, list[Profile]]:
    """Inverse of :func:`profiles_to_json`."""
    return {g: [Profile.from_json(p) for p in ps] for g, ps in data.items()}


# Scratch buffers are sized for blocks up to this many tokens (or the draft's block size, if larger).
MAX_BLOCK_SIZE = 64
