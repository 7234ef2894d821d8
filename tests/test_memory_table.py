"""`dflash_export.eval.scale.memory_table` runs the runtime's own allocation code, so a hybrid's KV buffers
cover its attention layers only and its Gated DeltaNet state does not grow with max_seq_len."""

from __future__ import annotations

from dflash_export.eval.scale import memory_table as mt


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


def test_the_mtp_head_rows_count_its_own_weights_and_buffers():
    """Qwen3.5-27B's head: an fc [5120, 10240] and one gated attention layer with its MLP, about 0.42 B
    parameters (issue 50's figure); its buffers are its K/V and the target's final hidden rows."""
    t = mt.QWEN3_5["Qwen3.8-27B + DFlash 2"]
    weights, buffers = mt.mtp_head_bytes(t, 2048)
    params = (weights - 3 * t["hidden"] * mt.FP32 - 2 * t["hidden"] * mt.FP32 - 2 * t["head_dim"] * mt.FP32) / mt.FP16
    assert abs(params / 1e9 - 0.42) < 0.01
    assert buffers == 2048 * (2 * 4 * 256 + 5120) * 2
    rows = {r["model"]: r for r in mt.rows(2048, 16, 2.5)}
    assert rows["Qwen3-8B"]["mtp"] is None and rows["Qwen3.5-4B"]["mtp"] > 0
