"""`dflash_export.eval.memory_table` runs the runtime's own allocation code, so a hybrid's KV buffers
cover its attention layers only and its Gated DeltaNet state does not grow with max_seq_len."""

from __future__ import annotations

from dflash_export.eval import memory_table as mt


def test_hybrid_rows_count_attention_kv_only_and_a_constant_state():
    short = {r["model"]: r for r in mt.rows(2048, 16, 2.5)}
    long = {r["model"]: r for r in mt.rows(8192, 16, 2.5)}
    t = mt.QWEN3_5["Qwen3.5-4B"]
    draft = mt.draft_config(t)
    want_kv = 2 * 2048 * 2 * (8 * t["kv_heads"] * t["head_dim"] + draft["layers"] * draft["kv_heads"] * draft["head_dim"])
    assert short["Qwen3.5-4B"]["kv"] == want_kv
    conv_dim = 2 * 16 * 128 + 32 * 128
    state = 2 * 24 * (3 * conv_dim * 2 + 32 * 128 * 128 * 4)  # two state sets, 24 GDN layers
    assert short["Qwen3.5-4B"]["other_buffers"] > state
    # what grows with the context besides KV is the taps buffer (fp16) and the int64 ids, never the state
    growth = (8192 - 2048) * (draft["taps"] * t["hidden"] * 2 + 8)
    assert long["Qwen3.5-4B"]["other_buffers"] - short["Qwen3.5-4B"]["other_buffers"] == growth
