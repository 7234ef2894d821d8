"""train-draft --init-from with more --layers or --taps grows the draft: the grown draft starts out
computing exactly what its source computes, and a real run writes a draft with the new shape."""

from __future__ import annotations

import json

import torch

from tiny_models import make_draft, make_target


def _draft(spec, state):
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.nn.layers import load_weights

    draft = DFlashDraft(spec).eval()
    load_weights(draft, state, "test")
    return draft


def test_grown_draft_starts_as_its_source(tmp_path):
    from dflash_export.checkpoint.draft import load_draft_spec, parse_draft_config
    from dflash_export.checkpoint.target import read_config
    from dflash_export.families.registry import load_target_spec
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.train.setup import grown_config, grown_weights

    tspec = load_target_spec(make_target(tmp_path / "t"))
    spec, state = load_draft_spec(make_draft(tmp_path / "d", tmp_path / "t", block_size=6), tspec)
    source = _draft(spec, state)
    cfg = grown_config(read_config(tmp_path / "d"), spec.arch.num_layers + 2, spec.target_layer_ids)
    grown_spec = parse_draft_config(cfg, tspec, "(grown)", None)
    assert grown_spec.arch.num_layers == spec.arch.num_layers + 2
    torch.manual_seed(0)
    grown = DFlashDraft(grown_spec)
    for p in grown.parameters():  # stands for the target-layer init: anything but zeros
        torch.nn.init.normal_(p, std=0.05)
    grown = _draft(grown_spec, grown_weights(grown, state))
    a = spec.arch
    feats = torch.randn(9, len(spec.target_layer_ids) * a.hidden_size)
    emb = torch.randn(spec.block_size, a.hidden_size)

    def past(n):
        return [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * n)]

    with torch.no_grad():
        want = source(feats, emb, *past(a.num_layers))
        got = grown(feats, emb, *past(grown_spec.arch.num_layers))
    assert torch.equal(got[0], want[0])  # the added layers add exact zeros to the residual stream
    assert len(got) == len(want) + 4  # and return their own context K/V
    for a_, b_ in zip(got[1:len(want)], want[1:]):
        assert torch.equal(a_, b_)
    assert grown.layers[-1].mlp.down_proj.weight.abs().sum() == 0
    assert grown.layers[-1].mlp.up_proj.weight.abs().sum() > 0  # the rest keeps its init: gradients flow


def test_train_draft_grows_init_from_draft(tmp_path, tmp_path_factory, capsys):
    import runtime_fixtures as rf

    from dflash_export.cli import main

    ck = rf.checkpoints("qwen3", tmp_path_factory)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "t5 t6 t7"}) + "\n")
    out = tmp_path / "grown"
    base = ["train-draft", "--target", str(ck / "target"), "--prompts", str(prompts), "--data-cache", str(tmp_path / "data"),
            "--max-new-tokens", "12", "--batch", "1", "--anchors", "2", "--device", "cpu", "--gen-dtype", "fp32",
            "--amp", "fp32", "--steps", "1", "--init-from", str(ck / "draft")]
    assert main(base + ["--out", str(out), "--layers", "3"]) == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["block_size"] == 8
    assert main(base + ["--out", str(tmp_path / "shrunk"), "--layers", "1"]) == 2
    assert "only --layers and --taps may differ, and only by growing" in capsys.readouterr().err
    grown_taps = tmp_path / "taps"
    base[base.index("--data-cache") + 1] = str(tmp_path / "data-3-taps")  # (the data carry the taps they read)
    assert main(base + ["--out", str(grown_taps), "--taps", "1", "2", "3"]) == 0, capsys.readouterr().err
    cfg = json.loads((grown_taps / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert main(base + ["--out", str(tmp_path / "reordered"), "--taps", "3", "1", "2"]) == 2  # the source's order kept
    assert "only by growing" in capsys.readouterr().err


def test_draft_grown_to_more_taps_starts_as_its_source(tmp_path):
    """Added taps get zero fc columns and the source's columns move to their taps' places: whatever the
    new taps' features are, the grown draft's output equals the source's on the source's taps."""
    from dflash_export.checkpoint.draft import load_draft_spec, parse_draft_config
    from dflash_export.checkpoint.target import read_config
    from dflash_export.families.registry import load_target_spec
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.train.setup import grown_config, grown_weights

    tspec = load_target_spec(make_target(tmp_path / "t"))
    spec, state = load_draft_spec(make_draft(tmp_path / "d", tmp_path / "t", block_size=6), tspec)
    old = list(spec.target_layer_ids)
    new = [0, old[0], 2, old[1]] if old == [1, 3] else sorted(set(old) | {0, 2})
    cfg = grown_config(read_config(tmp_path / "d"), spec.arch.num_layers, new)
    grown_spec = parse_draft_config(cfg, tspec, "(grown)", None)
    assert list(grown_spec.target_layer_ids) == new
    torch.manual_seed(0)
    grown = DFlashDraft(grown_spec)
    for p in grown.parameters():
        torch.nn.init.normal_(p, std=0.05)
    grown = _draft(grown_spec, grown_weights(grown, state, old, new))
    a = spec.arch
    by_tap = {t: torch.randn(9, a.hidden_size) for t in new}
    emb = torch.randn(spec.block_size, a.hidden_size)
    past = [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
    with torch.no_grad():
        want = _draft(spec, state)(torch.cat([by_tap[t] for t in old], -1), emb, *past)
        got = grown(torch.cat([by_tap[t] for t in new], -1), emb, *past)
    for a_, b_ in zip(got, want):
        torch.testing.assert_close(a_, b_, rtol=1e-6, atol=1e-6)
    assert grown.fc.weight[:, : a.hidden_size].abs().sum() == 0  # tap 0 is new: zero columns
