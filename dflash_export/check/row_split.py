"""Is an INT4 target graph's output independent of how its rows are split into calls?

Speculative decoding is lossless only if a token's logits do not depend on whether the target saw it
as row k of a verify call (past P, rows P..P+N) or as the only row of a plain step (past P + k).
`check` builds a past by a prefill of random ids, then compares at one MatMulNBits accuracy level:

- *split*: row 1 of a verify call (1 + N rows) against row 0 of the plain call that follows it with
  the verify's row 0 as past (logits and every layer's new K row);
- *split, padded*: the same with the plain call padded to two rows, as the runtime runs one-row calls
  where they round differently (`runtime.graphs.row_exact`);
- *padding*: row 0 of a 1-row call against row 0 of a 2-row call (same past).

Artifacts whose attention is split-invariant (manifest `target.row_exact`) give exactly 0 for
*split, padded* at every level. `scripts/int4_split_check.py` prints the table for an artifact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.backends.ort import disabled_optimizers
from runtime.graphs.tree import chain_inputs
from runtime.manifest import load_manifest

COLUMNS = ("split_logits", "split_keys", "split_padded_logits", "split_padded_keys", "padding_logits", "padding_keys")


def open_target(artifact: Path, level: int):
    """An onnxruntime session of the artifact's target graph at `level`, configured as the runtime does."""
    manifest = load_manifest(artifact)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    return ort.InferenceSession(str(artifact / manifest["target"]["graph"]), opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=disabled_optimizers(manifest, ort)), manifest


class TargetCalls:
    """Calls of the target graph with explicit past K/V lists (greedy, no sampling inputs)."""

    def __init__(self, session, manifest: dict):
        t = manifest["target"]
        self.sess, self.layers = session, int(t["num_layers"])
        self.kv_shape = (int(t["num_kv_heads"]), int(t["head_dim"]))
        self.hidden = int(t["hidden_size"])
        self.dtype = np.float16 if manifest.get("dtype") == "fp16" else np.float32
        self.outputs = [o.name for o in session.get_outputs()]

    def empty_past(self) -> list[tuple[np.ndarray, np.ndarray]]:
        z = np.zeros((0, *self.kv_shape), self.dtype)
        return [(z, z)] * self.layers

    @property
    def takes_ids(self) -> bool:
        """Whether the graph takes `proposal_ids` (its draft proposes) rather than `draft_hidden`."""
        return any(i.name == "proposal_ids" for i in self.sess.get_inputs())

    def proposals(self, rng, n: int, vocab: int) -> np.ndarray:
        """n random proposals in the graph's form: ids, or draft hidden rows its head ranks."""
        return (rng.integers(0, vocab, size=n).astype(np.int64) if self.takes_ids
                else rng.standard_normal((n, self.hidden)).astype(np.float32))

    def __call__(self, ids: list[int], proposals: np.ndarray, past) -> dict[str, np.ndarray]:
        feed = {"input_ids": np.array(ids, np.int64), "temperature": np.zeros(1, np.float32),
                "uniform": np.zeros(0, np.float32)}
        if self.takes_ids:
            feed["proposal_ids"] = proposals.astype(np.int64)
        else:
            feed["draft_hidden"] = proposals.astype(self.dtype)
        names = {i.name for i in self.sess.get_inputs()}
        feed.update({k: v for k, v in chain_inputs(len(proposals)).items() if k in names})  # a chain
        for i, (k, v) in enumerate(past):
            feed[f"past_key_{i}"], feed[f"past_value_{i}"] = k, v
        return dict(zip(self.outputs, self.sess.run(None, feed)))

    def extend(self, past, out: dict, rows: int):
        """`past` with the first `rows` new K/V rows of call output `out` appended."""
        return [(np.concatenate([k, out[f"key_{i}"][:rows]]), np.concatenate([v, out[f"value_{i}"][:rows]]))
                for i, (k, v) in enumerate(past)]

    def max_key_diff(self, a: dict, ra: int, b: dict, rb: int) -> float:
        return max(float(np.abs(a[f"key_{i}"][ra] - b[f"key_{i}"][rb]).max()) for i in range(self.layers))


def check(artifact: Path, level: int, past_len: int, proposals: int, seed: int = 0) -> dict[str, float]:
    """Max abs differences (logits, K rows) of the split and padding comparisons at `level`."""
    session, manifest = open_target(artifact, level)
    call = TargetCalls(session, manifest)
    rng = np.random.default_rng(seed)
    vocab = int(manifest["target"]["vocab_size"])
    prompt = rng.integers(min(100, vocab // 2), vocab, size=past_len).tolist()
    none = call.proposals(rng, 0, vocab)
    pre = call(prompt, none, call.empty_past())
    past = call.extend(call.empty_past(), pre, past_len)
    token = int(pre["next_ids"][-1])
    drafted = call.proposals(rng, proposals, vocab)
    verify = call(ids=[token], proposals=drafted, past=past)
    first = int(drafted[0] if call.takes_ids else verify["proposal_ids"][0])
    plain = call([first], none, call.extend(past, verify, 1))
    padded = call([first], drafted[:1], call.extend(past, verify, 1))
    one = call([token], none, past)
    two = call([token], drafted[:1], past)
    return {
        "split_logits": float(np.abs(verify["logits"][1] - plain["logits"][0]).max()),
        "split_keys": call.max_key_diff(verify, 1, plain, 0),
        "split_padded_logits": float(np.abs(verify["logits"][1] - padded["logits"][0]).max()),
        "split_padded_keys": call.max_key_diff(verify, 1, padded, 0),
        "padding_logits": float(np.abs(one["logits"][0] - two["logits"][0]).max()),
        "padding_keys": call.max_key_diff(one, 0, two, 0),
    }
