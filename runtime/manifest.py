"""The artifact manifest (`manifest.json`): what the exporter wrote and what the runtime needs.

The exporter writes it; the runtime reads and validates it before allocating anything. Bump
`MANIFEST_VERSION` whenever graph IO or buffer layout changes meaning: an artifact of another
version is refused with a message telling the user to rebuild.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import DFlashError

MANIFEST_FORMAT = "dflash_export.artifact"
MANIFEST_VERSION = 1
DTYPES = {"fp32": "float32", "fp16": "float16"}

_INT_FIELDS = {
    "target": ("num_layers", "hidden_size", "num_kv_heads", "head_dim", "vocab_size"),
    "draft": ("num_layers", "num_kv_heads", "head_dim", "block_size"),
}
# Buffers are allocated up front: refuse capacities no device could hold before allocating.
MAX_SEQ_LEN_LIMIT = 1 << 20

_REQUIRED = {
    "target": ("graph", "num_layers", "hidden_size", "num_kv_heads", "head_dim", "vocab_size"),
    "draft": ("graph", "num_layers", "num_kv_heads", "head_dim", "block_size", "mask_token_id", "target_layer_ids"),
}
# an artifact without a DFlash draft (`build --draft none`): its draft section names no graph, only the
# target graph's taps and the rows a step verifies by default
_REQUIRED_NO_DRAFT = ("graph", "block_size", "target_layer_ids")


def has_draft(manifest: dict[str, Any]) -> bool:
    """Whether the artifact has a DFlash draft graph (not built with `--draft none`)."""
    return manifest["draft"].get("graph", "draft.onnx") is not None  # (None: built without; absent: older manifests)


def load_manifest(artifact_dir: str | Path) -> dict[str, Any]:
    """Read and validate `DIR/manifest.json`.

    Returns:
        the manifest dict (see README, "Artifact layout").

    Raises:
        DFlashError: the directory or manifest is missing, malformed, from another format
            version, or names graph files that are absent.
    """
    artifact_dir = Path(artifact_dir)
    path = artifact_dir / "manifest.json"
    if not artifact_dir.is_dir():
        raise DFlashError(f"artifact directory {artifact_dir} does not exist; create it with `python -m dflash_export build`")
    if not path.is_file():
        raise DFlashError(f"{artifact_dir} has no manifest.json; it is not a dflash_export artifact (run `build`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{path} is not valid JSON ({exc}); rebuild the artifact") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DFlashError(f"{path} is not a dflash_export manifest; rebuild the artifact")
    version = manifest.get("version")
    if version != MANIFEST_VERSION:
        raise DFlashError(
            f"{path} has manifest version {version}, this runtime reads version {MANIFEST_VERSION}; "
            "rebuild the artifact with the matching dflash_export (`python -m dflash_export build`)"
        )
    draft = manifest.get("draft")
    drafted = not isinstance(draft, dict) or has_draft(manifest)
    for section, keys in {**_REQUIRED, **({} if drafted else {"draft": _REQUIRED_NO_DRAFT})}.items():
        missing = [k for k in keys if not isinstance(manifest.get(section), dict) or k not in manifest[section]]
        if missing:
            raise DFlashError(f"{path}: section {section!r} lacks {missing}; rebuild the artifact")
    int_fields = _INT_FIELDS if drafted else {**_INT_FIELDS, "draft": ("block_size",)}
    ints = [("max_seq_len",)] + [(sec, k) for sec, keys in int_fields.items() for k in keys]
    for key in ints:
        value = manifest
        for part in key:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if key == ("max_seq_len",) else 1):
            raise DFlashError(f"{path}: {'.'.join(key)} is {value!r}, expected a positive integer; rebuild the artifact")
    if manifest["max_seq_len"] > MAX_SEQ_LEN_LIMIT:
        raise DFlashError(f"{path}: max_seq_len {manifest['max_seq_len']} exceeds {MAX_SEQ_LEN_LIMIT}; rebuild with a smaller --max-seq-len")
    taps = manifest["draft"].get("target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
        raise DFlashError(f"{path}: draft.target_layer_ids is {taps!r}, expected a list of layer ids; rebuild the artifact")
    stops = manifest.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(isinstance(t, int) for t in stops):
        raise DFlashError(f"{path}: stop_token_ids is {stops!r}, expected a list of token ids; rebuild the artifact")
    graphs = ("target", "draft") if drafted else ("target",)
    for section in graphs:
        graph = manifest[section]["graph"]
        if not isinstance(graph, str) or Path(graph).name != graph:
            raise DFlashError(f"{path}: {section}.graph must be a file name inside the artifact (got {graph!r})")
    mask = manifest.get("mask_embedding")
    if drafted and (not isinstance(mask, str) or Path(mask).name != mask):
        raise DFlashError(f"{path}: mask_embedding must be a file name inside the artifact; rebuild the artifact")
    if manifest.get("dtype") not in DTYPES:
        raise DFlashError(f"{path}: unknown dtype {manifest.get('dtype')!r}; rebuild the artifact")
    for section in graphs:
        graph = artifact_dir / manifest[section]["graph"]
        if not graph.is_file():
            raise DFlashError(f"{artifact_dir}: {graph.name} is missing; the artifact is incomplete, rebuild it")
    if is_hybrid(manifest):
        _check_hybrid_fields(manifest["target"], path)
    return manifest


# a hybrid target's sizes the runtime allocates its states by (`runtime.graphs.recurrent`, `runtime.batching.states`)
_GDN_FIELDS = ("conv_kernel", "conv_dim", "num_value_heads", "key_head_dim", "value_head_dim")


def _check_hybrid_fields(target: dict[str, Any], path: Path) -> None:
    """Raise DFlashError unless a hybrid's `target.max_call_rows` and `target.gdn` sizes are positive integers."""
    gdn = target.get("gdn")
    fields = [("max_call_rows", target.get("max_call_rows"))]
    fields += [(f"gdn.{k}", gdn.get(k) if isinstance(gdn, dict) else None) for k in _GDN_FIELDS]
    for name, value in fields:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashError(f"{path}: target.{name} is {value!r}, expected a positive integer (a hybrid target's "
                              "state sizes); rebuild the artifact")


def greedy_form_exported(manifest: dict[str, Any]) -> bool:
    """Whether the target graph's `uniform` has its own length (`sampled_rows`), so greedy calls may
    bind none of it and skip the sampling branch; graphs exported before that tie it to 1 + N."""
    inputs = manifest.get("io", {}).get("target", {}).get("inputs", [])
    return any(i["name"] == "uniform" and i["shape"][:1] == ["sampled_rows"] for i in inputs)


def tree_inputs_exported(manifest: dict[str, Any]) -> bool:
    """Whether the target graph takes a verify tree (`tree_depth`, `tree_rank`, `tree_bias`:
    `runtime.graphs.tree`); graphs exported before that, and hybrid targets, verify chains only."""
    inputs = manifest.get("io", {}).get("target", {}).get("inputs", [])
    return any(i["name"] == "tree_depth" for i in inputs)


def draft_rows_exported(manifest: dict[str, Any]) -> bool:
    """Whether the draft graph takes `proposal_rows` (int64 `[R]`: the `draft_hidden` rows to return,
    its last layer cut to them); graphs exported before that return all B - 1 rows."""
    inputs = manifest.get("io", {}).get("draft", {}).get("inputs", [])
    return any(i["name"] == "proposal_rows" for i in inputs)


# What a draft graph ending in the proposal head returns instead of `draft_hidden`: int64 `[R, K]`
# candidate ids and fp32 `[R, K]` their probabilities (`dflash_export.nn.layers.proposal_table`).
DRAFT_PROPOSAL_OUTPUTS = ("draft_top_ids", "draft_top_probs")


def draft_proposes(manifest: dict[str, Any]) -> bool:
    """Whether the draft graph ranks the proposals itself (outputs `DRAFT_PROPOSAL_OUTPUTS`, the
    target takes `proposal_ids`), so the runtime sees the draft's confidence before the verify call;
    else (drafts without a proposal vocabulary, hybrid targets, older builds) it returns `draft_hidden`
    and the target's proposal head ranks them."""
    outputs = manifest.get("io", {}).get("draft", {}).get("outputs", [])
    return any(o["name"] == DRAFT_PROPOSAL_OUTPUTS[0] for o in outputs)


def target_takes_ids(manifest: dict[str, Any]) -> bool:
    """Whether the target graph takes its proposals as ids (`proposal_ids`): where the draft graph ranks
    them itself (`draft_proposes`), and in an artifact without a DFlash draft (the MTP head's chain and
    lookups are ids); else it takes the draft's hidden rows (`draft_hidden`) and ranks them itself."""
    inputs = manifest.get("io", {}).get("target", {}).get("inputs", [])
    return any(i["name"] == "proposal_ids" for i in inputs)


def draft_takes_anchor(manifest: dict[str, Any]) -> bool:
    """Whether the draft graph takes `anchor_ids` (int64 `[1]`, the last committed token): a DFlash 2
    draft, whose selector walks the block from it."""
    inputs = manifest.get("io", {}).get("draft", {}).get("inputs", [])
    return any(i["name"] == "anchor_ids" for i in inputs)


def fixed_draft_block(manifest: dict[str, Any]) -> int | None:
    """The block size a draft graph is fixed to (its `block_embeddings` rows are a number, not a name:
    a DFlash 2 draft unrolls its selector over the block), or None where any block runs."""
    inputs = manifest.get("io", {}).get("draft", {}).get("inputs", [])
    rows = next((i["shape"][0] for i in inputs if i["name"] == "block_embeddings"), None)
    return rows if isinstance(rows, int) else None


def proposal_ranks(manifest: dict[str, Any]) -> int:
    """K, the candidates per row a proposing draft returns (`draft_top_ids` is `[R, K]`)."""
    out = next(o for o in manifest["io"]["draft"]["outputs"] if o["name"] == DRAFT_PROPOSAL_OUTPUTS[0])
    return int(out["shape"][1])


def layer_types(section: dict[str, Any]) -> list[str]:
    """A graph section's (`manifest["target"]` or `["draft"]`) type per layer: "full_attention",
    "linear_attention" (a hybrid's Gated DeltaNet: a recurrent state, no KV cache) or
    "sliding_attention" (a windowed draft layer: KV as full attention); all full attention when absent."""
    return list(section.get("layer_types") or ["full_attention"] * int(section["num_layers"]))


def is_hybrid(manifest: dict[str, Any]) -> bool:
    """Whether the target has Gated DeltaNet layers (`runtime.graphs.recurrent`)."""
    return "linear_attention" in layer_types(manifest["target"])


def load_mask_embedding(path: Path, hidden: int) -> np.ndarray:
    """The mask token's embedding row `[hidden]` (float) from the artifact, validated.

    Raises:
        DFlashError: unreadable, or not a float vector of `hidden` values (a damaged artifact).
    """
    try:
        row = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DFlashError(f"cannot read {path.name} ({exc}); the artifact is damaged, rebuild it") from None
    if row.ndim != 1 or row.shape[0] != hidden or row.dtype.kind != "f":
        raise DFlashError(
            f"{path.name} holds a {row.dtype} array of shape {row.shape}, expected float [{hidden}]; rebuild the artifact"
        )
    return row


# names of the graph's per-layer inputs and outputs (`gdn_io_names`)
STATE_INPUTS = ("conv_state", "recurrent_state")


STATE_OUTPUTS = ("conv_state_out", "recurrent_state_out")


ROW_KINDS = ("qkv", "a", "b")


def gdn_io_names(layer: int) -> tuple[list[str], list[str]]:
    """Input and output names of Gated DeltaNet layer `layer` in a hybrid target graph, in order."""
    inputs = [f"{k}_{layer}" for k in STATE_INPUTS] + [f"pending_{k}_{layer}" for k in ROW_KINDS]
    outputs = [f"{k}_{layer}" for k in STATE_OUTPUTS] + [f"{k}_{layer}" for k in ROW_KINDS]
    return inputs, outputs


# The target graph's inputs that describe a verify tree (after `uniform`, before the caches).
TREE_INPUTS = ("tree_depth", "tree_rank", "tree_bias")


# A target taking proposal ids (the draft ranked them) needs only the tree's shape: no ranks.
TREE_SHAPE_INPUTS = ("tree_depth", "tree_bias")


# The batched target graph (`build --batched`, `runtime.batching`): its section and file name, and its
# inputs before the caches (`dflash_export.nn.batched`)
BATCHED_GRAPH = "target_batched"
BATCHED_INPUTS = ("input_ids", "past_lengths", "key_index", "logit_rows", "temperature", "uniform")
# a hybrid's batched graph also takes each sequence's GDN state slot and pending rows (`nn.batched_hybrid`)
BATCHED_HYBRID_INPUTS = ("state_slots", "pending_index", "pending_lengths")
DEFAULT_MAX_BATCH = 4  # sequences a batched engine decodes at once (measured: docs/performance.md#batched-serving)
DEFAULT_PREFILL_CHUNK = 256  # prompt rows per prefill call: what a long prompt makes running streams wait at most


BATCHED_DRAFT_GRAPH = "draft_batched"
BATCHED_DRAFT_INPUTS = ("context_hidden", "context_rows", "context_positions", "context_index", "context_lengths",
                        "past_lengths", "key_index", "block_embeddings", "proposal_rows")


def has_batched_draft(manifest: dict[str, Any]) -> bool:
    """Whether the artifact has the batched draft graph (`build --batched` with a DFlash draft that
    proposes ids): one call drafts for several sequences (`runtime.batching.drafts`)."""
    return BATCHED_DRAFT_GRAPH in manifest and BATCHED_DRAFT_GRAPH in manifest.get("io", {})


def batched_feeds_draft(manifest: dict[str, Any]) -> bool:
    """Whether the batched target graph outputs `taps` and `next_embeddings` (artifacts built since
    batched speculation exists), which the draft of each sequence reads."""
    return bool((manifest.get(BATCHED_GRAPH) or {}).get("draft_features"))


def check_batched_graph(manifest: dict[str, Any], artifact_dir: Path) -> None:
    """Raise DFlashError unless the artifact has a batched target graph (built with `--batched`), and the
    batched draft graph where its manifest lists one."""
    section = manifest.get(BATCHED_GRAPH)
    if not isinstance(section, dict):
        raise DFlashError(f"{artifact_dir} has no batched target graph; rebuild it with `python -m dflash_export build "
                          "--batched` to serve several requests at once (or serve with --max-batch 1)")
    parts = [("target", section)] + ([("draft", manifest[BATCHED_DRAFT_GRAPH])] if BATCHED_DRAFT_GRAPH in manifest else [])
    for what, part in parts:
        graph = part.get("graph") if isinstance(part, dict) else None
        if not isinstance(graph, str) or Path(graph).name != graph or not (Path(artifact_dir) / graph).is_file():
            raise DFlashError(f"{artifact_dir}: the batched {what} graph {graph!r} is missing; the artifact is incomplete, "
                              "rebuild it")
    for key in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
        value = section.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashError(f"{artifact_dir}: {BATCHED_GRAPH}.{key} is {value!r}, expected a positive integer; rebuild")


MTP_INPUTS = ("input_ids", "hidden", "past_key", "past_value")  # the MTP head's graph (`mtp.onnx`)


def has_mtp(manifest: dict[str, Any]) -> bool:
    """The artifact carries the target's multi-token-prediction head (`mtp.onnx`; Qwen3.5 / Qwen3.6)."""
    return isinstance(manifest.get("mtp"), dict)
