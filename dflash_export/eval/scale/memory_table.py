"""Device memory of a DFlash pair (Qwen3 or Qwen3.5 hybrid target + 5-layer draft) at fp16, per Jetson device.

Answers which released model sizes fit which Jetson before anything is exported. Weights are counted
from the published configs (hard-coded below; fp32 islands at 4 bytes); runtime buffers come from the
runtime's own allocation code (`Session._allocate`) run against a counting backend, so they follow the
real formulas; activations are an unfused upper-bound ESTIMATE of the TensorRT context scratch, not a
measurement. A pair fits a device when the total is within its memory (shared by CPU and GPU) minus
`--reserve-gib` for the OS, CUDA/TensorRT and the process. Sizes marked ASSUMED below were not published.

    python scripts/memory_table.py [--max-seq-len 2048] [--block-size 16] [--int4] [--markdown]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

GIB = 1 << 30

# Published Hugging Face configs (Qwen/Qwen3-*): layers, hidden, heads, kv heads, head_dim, intermediate, vocab, tied.
QWEN3 = {
    "Qwen3-0.6B": dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936, tie=True),
    "Qwen3-1.7B": dict(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, inter=6144, vocab=151936, tie=True),
    "Qwen3-4B": dict(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, inter=9728, vocab=151936, tie=True),
    "Qwen3-8B": dict(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=12288, vocab=151936, tie=False),
}
# Qwen3.5 hybrids (Gated DeltaNet + every 4th layer full attention). 32 layers, hidden, 16/4 heads, head_dim 256,
# vocab 248320 and 8 attention layers are published figures; intermediate (4B), tying and the GDN head layout
# (16 key heads, 32 value heads, 128 wide, conv 4: transformers' Qwen3_5TextConfig defaults) are ASSUMED.
QWEN3_5 = {
    "Qwen3.5-4B": dict(layers=32, hidden=2560, heads=16, kv_heads=4, head_dim=256, inter=9216, vocab=248320, tie=True,
                       k_heads=16, v_heads=32, gdn_dim=128, conv=4, attention_every=4),
    "Qwen3.5-9B": dict(layers=32, hidden=4096, heads=16, kv_heads=4, head_dim=256, inter=12288, vocab=248320, tie=False,
                       k_heads=16, v_heads=32, gdn_dim=128, conv=4, attention_every=4),
    # DFlash 2's released target (dflash2-notes): 64 layers, hidden 5120, vocab 248320 published; the rest is
    # Qwen3.5-27B's layout, ASSUMED. Its draft: the released Qwen3.8-27B-DFlash2 (`dflash2_extra_bytes`).
    "Qwen3.8-27B + DFlash 2": dict(layers=64, hidden=5120, heads=24, kv_heads=4, head_dim=256, inter=17408,
                                   vocab=248320, tie=False, k_heads=16, v_heads=48, gdn_dim=128, conv=4,
                                   attention_every=4, draft="dflash2"),
}
# Draft layout: the released z-lab Qwen3-4B/8B drafts (5 layers, target hidden/intermediate, 32/8/128 heads,
# 5 taps); for 0.6B/1.7B, which have no released draft, the same layout at the target's sizes is ASSUMED, and
# so is the same 5-layer draft for the Qwen3.5 hybrids (their released drafts' configs were not available).
DRAFT_LAYERS, DRAFT_TAPS = 5, 5
DEVICES = {  # total memory (GiB, shared CPU/GPU)
    "Orin Nano 8GB": 8,
    "Orin NX 16GB": 16,
    "AGX Orin 64GB": 64,
    "Thor (AGX, 128GB)": 128,
    "24 GB GPU": 24,  # a desktop card: its own memory (the reserve then stands for CUDA and the context)
}
DFLASH2_RANK, DFLASH2_KERNEL, DFLASH2_GROUP = 256, 2, 16
FP16, FP32 = 2, 4


def draft_config(target: dict) -> dict:
    heads, kv, hd = (32, 8, 128) if target["hidden"] >= 2560 else (target["heads"], target["kv_heads"], target["head_dim"])
    return dict(layers=DRAFT_LAYERS, hidden=target["hidden"], heads=heads, kv_heads=kv, head_dim=hd, inter=target["inter"],
                taps=DRAFT_TAPS)


INT4_BLOCK = 128  # build --quant int4 default: half a byte a weight plus one fp16 scale per 128


def _layer_bytes(c: dict, int4: bool = False, gated: bool = False) -> int:
    """One attention decoder layer; `gated`: Qwen3.5's q_proj also emits the output gate (twice the
    query rows; o_proj reads the query width)."""
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    mats = (2 if gated else 1) * h * q + 2 * h * kv + q * h + 3 * h * c["inter"]
    norms = 2 * h + 2 * c["head_dim"]  # input/post-attention norms, q_norm/k_norm (fp32)
    per_weight = 0.5 + FP16 / INT4_BLOCK if int4 else FP16
    return int(mats * per_weight) + norms * FP32


def hybrid_types(t: dict) -> list[str]:
    return ["full_attention" if (i + 1) % t["attention_every"] == 0 else "linear_attention" for i in range(t["layers"])]


def _gdn_layer_bytes(t: dict, int4: bool) -> int:
    h, inter = t["hidden"], t["inter"]
    conv_dim = 2 * t["k_heads"] * t["gdn_dim"] + t["v_heads"] * t["gdn_dim"]
    mats = h * conv_dim + h * t["v_heads"] * t["gdn_dim"] + 2 * h * t["v_heads"] + t["v_heads"] * t["gdn_dim"] * h + 3 * h * inter
    per_weight = 0.5 + FP16 / INT4_BLOCK if int4 else FP16
    return int(mats * per_weight) + conv_dim * t["conv"] * FP16 + (2 * h + t["gdn_dim"] + 2 * t["v_heads"]) * FP32


def hybrid_weight_bytes(t: dict, d: dict, int4: bool = False) -> tuple[int, int]:
    """(target, draft) weight bytes of a Qwen3.5 hybrid: GDN layers, gated attention layers (q_proj emits
    query and gate: twice the query width), embedding/head fp16, norms and decay parameters fp32."""
    types = hybrid_types(t)
    target = (types.count("linear_attention") * _gdn_layer_bytes(t, int4) + types.count("full_attention") * _layer_bytes(t, int4, gated=True)
              + t["vocab"] * t["hidden"] * FP16 * (1 if t["tie"] else 2) + t["hidden"] * FP32)
    draft = weight_bytes(t, d)[1] + (dflash2_extra_bytes(t, d) if t.get("draft") == "dflash2" else 0)
    return target, draft


def mtp_head_bytes(t: dict, max_seq_len: int) -> tuple[int, int]:
    """(weights, runtime buffers) of a hybrid's multi-token-prediction head (`mtp.onnx`, kept unquantized):
    the fc [d, 2d], one gated attention layer with its MLP and three fp32 norms (embedding and LM head are
    the target's, shared); its K/V cache [S, Hkv, D] x 2 and the target's final hidden rows [S, d], fp16."""
    weights = 2 * t["hidden"] * t["hidden"] * FP16 + _layer_bytes(t, gated=True) + 3 * t["hidden"] * FP32
    buffers = max_seq_len * (2 * t["kv_heads"] * t["head_dim"] + t["hidden"]) * FP16
    return weights, buffers


def dflash2_extra_bytes(t: dict, d: dict) -> int:
    """What a DFlash 2 draft graph holds beyond v1's layers (fp16): two grouped dynamic convolutions per
    layer (base kernels and kernel projections), the selector (hidden projection, two [vocab, 256]
    codebooks) and the target's LM head, which moves into the draft graph (the target keeps its own)."""
    h = d["hidden"]
    conv = 2 * DFLASH2_KERNEL * h + (2 * DFLASH2_KERNEL * h // DFLASH2_GROUP) * h
    selector = DFLASH2_RANK * h + 2 * t["vocab"] * DFLASH2_RANK
    return (d["layers"] * 2 * conv + selector + t["vocab"] * h) * FP16


def weight_bytes(t: dict, d: dict, int4: bool = False) -> tuple[int, int]:
    """(target, draft) weight bytes at fp16 with fp32 norms and fc; `int4`: the target's decoder linears
    as `build --quant int4` stores them (embedding, LM head and the draft stay fp16)."""
    target = (t["layers"] * _layer_bytes(t, int4) + t["vocab"] * t["hidden"] * FP16 * (1 if t["tie"] else 2)
              + t["hidden"] * FP32)
    draft = d["layers"] * _layer_bytes(d) + d["taps"] * d["hidden"] * d["hidden"] * FP32 + 2 * d["hidden"] * FP32
    return target, draft


class CountingBackend:
    """A runtime Backend that only counts what `Session._allocate` asks for."""

    name = "count"

    def __init__(self):
        self.bytes = 0

    def alloc(self, dtype, rows, row_shape=()):
        from runtime.backends.base import Buffer

        buf = Buffer(dtype, rows * int(np.prod(row_shape, dtype=np.int64) if row_shape else 1), row_shape)
        self.bytes += buf.capacity * buf.dtype.itemsize
        return buf

    def write(self, view, values):
        pass


def runtime_buffer_bytes(t: dict, d: dict, max_seq_len: int, block_size: int) -> int:
    """Bytes the runtime allocates for this pair: `Session._allocate` itself, on a counting backend (static
    K/V per attention layer at max_seq_len, taps, block-sized scratch, fp32 logits for up to 64 rows; for a
    hybrid also its Gated DeltaNet state and recorded-row sets, constant in max_seq_len)."""
    from runtime.session import Session

    target = {"num_layers": t["layers"], "hidden_size": t["hidden"], "num_kv_heads": t["kv_heads"],
              "head_dim": t["head_dim"], "vocab_size": t["vocab"]}
    if "k_heads" in t:  # a hybrid: KV for its attention layers only, plus the runtime's Gated DeltaNet state sets
        target.update(layer_types=hybrid_types(t), max_call_rows=64, gdn={
            "conv_kernel": t["conv"], "conv_dim": 2 * t["k_heads"] * t["gdn_dim"] + t["v_heads"] * t["gdn_dim"],
            "num_value_heads": t["v_heads"], "key_head_dim": t["gdn_dim"], "value_head_dim": t["gdn_dim"]})
    manifest = {
        "max_seq_len": max_seq_len,
        "target": target,
        "draft": {"num_layers": d["layers"], "num_kv_heads": d["kv_heads"], "head_dim": d["head_dim"],
                  "target_layer_ids": list(range(d["taps"])), "block_size": block_size},
        "mask_embedding": "mask.npy",
    }
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "mask.npy", np.zeros(t["hidden"], np.float32))
        sess = Session.__new__(Session)
        sess.manifest, sess.backend, sess.artifact_dir = manifest, CountingBackend(), Path(tmp)
        sess.dtype, sess.max_seq_len, sess.block_size = np.dtype(np.float16), max_seq_len, block_size
        sess.keep_logits = True  # counted: the fp32 logits rows the loop may read
        sess._allocate()
        return sess.backend.bytes


def kv_bytes(t: dict, d: dict, max_seq_len: int) -> int:
    """The K/V part of the runtime buffers (2 per attention layer, [max_seq_len, Hkv, D] fp16)."""
    attn_layers = hybrid_types(t).count("full_attention") if "k_heads" in t else t["layers"]
    return 2 * max_seq_len * FP16 * (attn_layers * t["kv_heads"] * t["head_dim"] + d["layers"] * d["kv_heads"] * d["head_dim"])


def activation_bytes(t: dict, d: dict, max_seq_len: int, max_block: int = 64) -> int:
    """ESTIMATED TensorRT context scratch: per engine the largest profile, both engines summed. Prefill
    dominates: the exported attention materialises fp32 scores [H, T, T] (a fused kernel needs far less)."""
    S, mb = max_seq_len, max_block

    def layer(c, rows, keys):
        q = c["heads"] * c["head_dim"]
        hidden = rows * c["hidden"] * (2 * FP16 + FP32)  # residual, normed input, fp32 norm temporaries
        qkv = rows * (q + 2 * c["kv_heads"] * c["head_dim"]) * (FP16 + FP32)  # projections + fp32 RoPE temporaries
        scores = c["heads"] * rows * keys * (2 * FP32 + FP16)  # fp32 scores, fp32 softmax, fp16 probabilities
        mlp = 3 * rows * c["inter"] * FP16
        return hidden + qkv + max(scores, mlp)

    if "k_heads" in t:  # a hybrid feeds its prompt in calls of 64 rows: no [S, S] prefill scores
        attn = dict(t, heads=2 * t["heads"])
        gdn_chunk = t["v_heads"] * mb * (mb + 4 * t["gdn_dim"]) * FP32 * 4  # WY matrices and per-row q/k/v/decays
        target = max(layer(attn, mb, S), gdn_chunk) + 4 * mb * t["vocab"] * FP32
        return target + max(layer(d, mb, S + mb) + (mb) * d["taps"] * d["hidden"] * FP32 * 2, layer(d, mb, S + mb))
    prefill = layer(t, S - 1, S - 1)
    verify = layer(t, mb, S) + 4 * mb * t["vocab"] * FP32  # logits, softmax, cumsum, compare (sampling path)
    target = max(prefill, verify)
    draft_first = layer(d, mb, S + mb) + (S - 1) * d["taps"] * d["hidden"] * FP32 * 2  # fc input/output in fp32
    draft_step = layer(d, mb, S + mb)
    return target + max(draft_first, draft_step)


def rows(max_seq_len: int, block_size: int, reserve_gib: float, int4: bool = False) -> list[dict]:
    out = []
    for name, t in {**QWEN3, **QWEN3_5}.items():
        d = draft_config(t)
        wt, wd = hybrid_weight_bytes(t, d, int4) if "k_heads" in t else weight_bytes(t, d, int4)
        buffers = runtime_buffer_bytes(t, d, max_seq_len, block_size)
        kv = kv_bytes(t, d, max_seq_len)
        act = activation_bytes(t, d, max_seq_len)
        total = wt + wd + buffers + act
        out.append({
            "model": name, "target_weights": wt, "draft_weights": wd, "kv": kv, "other_buffers": buffers - kv,
            "activations": act, "total": total,
            "mtp": sum(mtp_head_bytes(t, max_seq_len)) if "k_heads" in t else None,
            "fits": {dev: total <= (mem - reserve_gib) * GIB for dev, mem in DEVICES.items()},
        })
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command line (`scripts/memory_table.py`): print the table; returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reserve-gib", type=float, default=2.5, help="memory kept for the OS, CUDA/TensorRT and the process")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--int4", action="store_true", help="target decoder linears as build --quant int4 (block 128)")
    args = p.parse_args(argv)
    table = rows(args.max_seq_len, args.block_size, args.reserve_gib, args.int4)
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    head = ["model (int4 W4A16)" if args.int4 else "model (fp16)", "target weights", "draft weights", "KV buffers", "other buffers", "activations (est.)", "total GiB",
            "+ MTP head", *DEVICES]
    lines = []
    if args.markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
    else:
        lines.append("  ".join(head))
    for r in table:
        cells = [r["model"], g(r["target_weights"]), g(r["draft_weights"]), g(r["kv"]), g(r["other_buffers"]),
                 g(r["activations"]), g(r["total"]), "-" if r["mtp"] is None else g(r["mtp"]),
                 *("yes" if r["fits"][dev] else "no" for dev in DEVICES)]
        lines.append(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))
    print(f"max_seq_len {args.max_seq_len}, block {args.block_size}, reserve {args.reserve_gib} GiB (GiB = 2^30 bytes)")
    print("\n".join(lines))
    return 0
