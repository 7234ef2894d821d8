"""User errors: each raises one DFlashError whose message names the problem and the fix, and a failed
build leaves no partial artifact (neither the --out directory nor a temporary sibling)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import runtime
import runtime_fixtures as rf
from dflash_export.build import BuildOptions, build
from runtime import DFlashError


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    """Good tiny checkpoints: `target/` (4 layers, hidden 64, vocab 96) and `draft/` (taps [1, 3])."""
    return rf.checkpoints("qwen3", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, fn) -> Path:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg, indent=2))
    return model_dir


def build_fails(target, draft, out: Path, match: str) -> str:
    """Run build, expect one DFlashError matching `match`, and no partial output. Returns the message."""
    with pytest.raises(DFlashError, match=match) as err:
        build(BuildOptions(str(target) if target is not None else None, str(draft) if draft is not None else None, out,
              max_seq_len=32, quiet=True))
    msg = str(err.value)
    assert "\n" not in msg and msg.strip() == msg
    rf.no_partial_output(out)
    return msg


# ---- target resolution ----------------------------------------------------------------------------
def test_missing_target_dir(ckpt, tmp_path):
    missing = tmp_path / "no-such-model"
    msg = build_fails(missing, ckpt / "draft", tmp_path / "art", "target directory .* does not exist")
    assert str(missing) in msg  # names the path


def test_unknown_target_name(ckpt, tmp_path):
    msg = build_fails("Qwen9-1T", ckpt / "draft", tmp_path / "art", r"target 'Qwen9-1T' is neither")
    assert "Llama-3.1-8B-Instruct" in msg


def test_known_name_not_in_hf_cache(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    msg = build_fails("Qwen3-8B", None, tmp_path / "art", "not in the local Hugging Face cache")
    assert "hf download Qwen/Qwen3-8B" in msg and "--target DIR" in msg
    # names are matched case-insensitively, and the repository id works as well
    build_fails("qwen3-8b", None, tmp_path / "art", r"Qwen3-8B \(Qwen/Qwen3-8B\) is not in the local")
    build_fails("Qwen/Qwen3-8B", None, tmp_path / "art", "hf download Qwen/Qwen3-8B")


def test_known_target_cached_but_released_draft_missing(ckpt, tmp_path, monkeypatch):
    hub = tmp_path / "hf_home" / "hub"
    snap = hub / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    shutil.copytree(ckpt / "target", snap)
    (hub / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (hub / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    msg = build_fails("Qwen3-8B", None, tmp_path / "art", "released draft z-lab/Qwen3-8B-DFlash-b16")
    assert "hf download z-lab/Qwen3-8B-DFlash-b16" in msg and "--draft DIR" in msg


def test_missing_draft_dir(ckpt, tmp_path):
    build_fails(ckpt / "target", tmp_path / "no-draft", tmp_path / "art", "neither a directory nor a repository")


# ---- draft/target mismatches ------------------------------------------------------------------------
def test_draft_without_taps_and_fc_not_matching_the_fallback(ckpt, tmp_path):
    import tiny_models

    # fc trained for 3 taps; the config declares none, so the reference fallback (2 draft layers ->
    # 2 taps, [1, 1] for 4 target layers) gives 128 features where fc takes 192
    d = tiny_models.make_draft(tmp_path / "d", ckpt / "target", taps=[0, 1, 2])
    edit_config(d, lambda c: c["dflash_config"].pop("target_layer_ids"))
    msg = build_fails(ckpt / "target", d, tmp_path / "art", "fc.weight expects 192 input features")
    assert "2 taps x hidden 64 = 128" in msg


def test_taps_out_of_range(ckpt, tmp_path):
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c["dflash_config"].update(target_layer_ids=[1, 4]))
    msg = build_fails(ckpt / "target", d, tmp_path / "art", r"tap layers \[4\] do not exist in the target")
    assert "4 layers, ids 0..3" in msg


def test_negative_tap(ckpt, tmp_path):
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c["dflash_config"].update(target_layer_ids=[-1, 3]))
    build_fails(ckpt / "target", d, tmp_path / "art", r"tap layers \[-1\] do not exist")


def test_tap_count_does_not_match_fc(ckpt, tmp_path):
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 3]))
    msg = build_fails(ckpt / "target", d, tmp_path / "art", "fc.weight expects 128 input features but 3 taps")
    assert "tap list does not match the weights" in msg


def test_hidden_size_mismatch(ckpt, tmp_path):
    import tiny_models

    other = tiny_models.make_target(tmp_path / "other", hidden=48)
    d = tiny_models.make_draft(tmp_path / "d", other)
    build_fails(ckpt / "target", d, tmp_path / "art", "hidden_size 48 != target hidden_size 64")


def test_head_layout_mismatch(ckpt, tmp_path):
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c.update(num_key_value_heads=4))
    msg = build_fails(ckpt / "target", d, tmp_path / "art", r"k_proj.weight has shape \(32, 64\) but the config implies \(64, 64\)")
    assert "config and weights disagree" in msg


def test_mask_id_outside_vocabulary(ckpt, tmp_path):
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c["dflash_config"].update(mask_token_id=96))
    build_fails(ckpt / "target", d, tmp_path / "art", r"mask_token_id 96 is outside the target vocabulary \[0, 96\)")


@pytest.mark.parametrize("content, match", [
    ("not json", r"draft_vocab.json is not valid JSON"),
    ('{"token_ids": []}', r"must hold \{\"token_ids\": \[int, \.\.\.\]\} \(non-empty\)"),
    ('{"token_ids": [1, 2, 2]}', r"token ids must be unique and in \[0, 96\)"),
    ('{"token_ids": [1, 96]}', r"token ids must be unique and in \[0, 96\)"),
    ('{"token_ids": [1, 2.5]}', r"must hold"),
])
def test_bad_draft_vocab(ckpt, tmp_path, content, match):
    d = copy_dir(ckpt / "draft", tmp_path / "d")
    (d / "draft_vocab.json").write_text(content)
    msg = build_fails(ckpt / "target", d, tmp_path / "art", match)
    assert "delete it to use the full vocabulary" in msg or "target's vocabulary" in msg


def test_draft_vocab_not_a_plain_readable_file(ckpt, tmp_path):
    """A directory of that name is an error, not "no vocabulary"; a deeply nested file gets a clear line."""
    d = copy_dir(ckpt / "draft", tmp_path / "d")
    (d / "draft_vocab.json").mkdir()
    msg = build_fails(ckpt / "target", d, tmp_path / "art", r"draft_vocab.json is not a regular file; remove it")
    (d / "draft_vocab.json").rmdir()
    (d / "draft_vocab.json").symlink_to(tmp_path / "gone.json")
    build_fails(ckpt / "target", d, tmp_path / "art1", r"draft_vocab.json is a link to .*gone.json, which does not exist; fix the link")
    (d / "draft_vocab.json").unlink()
    (d / "draft_vocab.json").write_text("[" * 100000 + "]" * 100000)
    msg = build_fails(ckpt / "target", d, tmp_path / "art2", r"nested too deeply to be a vocabulary file")
    assert "delete it to use the full vocabulary" in msg


def test_sliding_attention_draft(ckpt, tmp_path):
    """Drafts may slide (Qwen3.6 drafts; tests/test_sliding_drafts.py): accepted with their window, and a
    sliding layer without `sliding_window` is refused naming the field."""
    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.draft import load_draft_spec

    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"),
                    lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    spec, _ = load_draft_spec(d, load_target_spec(ckpt / "target"))
    assert spec.layer_types == ("sliding_attention", "full_attention") and spec.sliding_window == 8
    edit_config(d, lambda c: c.pop("sliding_window"))
    build_fails(ckpt / "target", d, tmp_path / "art", r"layers \[0\] are sliding_attention but config.json's sliding_window is None")


def test_sliding_attention_target(ckpt, tmp_path):
    t = edit_config(copy_dir(ckpt / "target", tmp_path / "t"),
                    lambda c: c.update(layer_types=["full_attention", "sliding_attention"] * 2))
    build_fails(t, ckpt / "draft", tmp_path / "art", r"target .* uses layer types \['sliding_attention'\]")


def test_unsupported_target_architecture(ckpt, tmp_path):
    t = edit_config(copy_dir(ckpt / "target", tmp_path / "t"),
                    lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral"))
    build_fails(t, ckpt / "draft", tmp_path / "art",
                r"supported: Qwen3ForCausalLM, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration$")


def test_unsupported_draft_architecture(ckpt, tmp_path):
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c.update(architectures=["EagleDraftModel"]))
    build_fails(ckpt / "target", d, tmp_path / "art", r"declares architectures \['EagleDraftModel'\]; supported drafts: "
                r"DFlashDraftModel, DFlash2DraftModel$")


@pytest.mark.nightly  # two builds through the CLI; `make test`: test_failed_rebuild_keeps_the_old_artifact (no partial output)
def test_ctrl_c_before_the_swap_leaves_nothing_and_after_it_says_too_late(ckpt, tmp_path, monkeypatch, capsys):
    """Ctrl-C during build (here: while the graphs are checked) removes everything and exits 130;
    one right after the artifact was swapped into place exits 130 saying it came too late, with the
    complete artifact left."""
    import dflash_export.build as build_mod
    from dflash_export.checkpoint import outputs
    from dflash_export.cli import main

    args = ["build", "--target", str(ckpt / "target"), "--draft", str(ckpt / "draft"), "--max-seq-len", "32"]
    real_check, real_replace = build_mod.check_graph, outputs.replace_directory

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod, "check_graph", interrupt)
    assert main([*args, "--out", str(tmp_path / "early")]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")
    rf.no_partial_output(tmp_path / "early")
    monkeypatch.setattr(build_mod, "check_graph", real_check)

    def swap_then_interrupt(*a, **k):
        real_replace(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "replace_directory", swap_then_interrupt)
    late = tmp_path / "late"
    assert main([*args, "--out", str(late)]) == 130
    assert f"interrupted too late: {late} was already written (a complete artifact)" in capsys.readouterr().err
    assert runtime.load(late).generate([5, 6], max_new_tokens=3, stop_token_ids=[]).output_ids


QWEN3_5_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


@pytest.mark.parametrize("config, match", [
    (dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5"),
     r"Qwen3_5ForConditionalGeneration checkpoint without a text_config object"),
    (dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", **QWEN3_5_TEXT),
     r"weights do not match the architecture \(missing \['model.layers.0.linear_attn"),
    (dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **QWEN3_5_TEXT),
     r"mixture-of-experts Qwen3.5/3.6 checkpoint .* dense"),
    (dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", **{**QWEN3_5_TEXT, "linear_num_value_heads": 3}),
     r"linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    (dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
          **{k: v for k, v in QWEN3_5_TEXT.items() if k != "hidden_size"}), r"lacks the field 'hidden_size'"),
])
def test_qwen3_5_targets_are_recognised_and_refused_by_name(ckpt, tmp_path, config, match):
    """Qwen3.5/3.6: a dense hybrid config is validated (a Qwen3 checkpoint's weights under it are named
    as not matching); mixture-of-experts variants are refused as such; a malformed config names its field."""
    t = edit_config(copy_dir(ckpt / "target", tmp_path / "t"), lambda c: (c.clear(), c.update(config)))
    build_fails(t, ckpt / "draft", tmp_path / "art", match)


# ---- corrupted or incomplete checkpoints -------------------------------------------------------------
@pytest.mark.parametrize("which", ["target", "draft"])
def test_truncated_safetensors(ckpt, tmp_path, which):
    bad = copy_dir(ckpt / which, tmp_path / which)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    dirs = {"target": ckpt / "target", "draft": ckpt / "draft", which: bad}
    msg = build_fails(dirs["target"], dirs["draft"], tmp_path / "art", "corrupted or truncated")
    assert str(f) in msg


def test_non_finite_draft_weights_refused(ckpt, tmp_path):
    """A diverged training run's NaN weights would export and propose garbage silently: refused."""
    import numpy as np

    d = copy_dir(ckpt / "draft", tmp_path / "d")
    rf._patch_safetensors(d / "model.safetensors", lambda s: {**s, "fc.weight": np.full_like(s["fc.weight"], np.nan)})
    build_fails(ckpt / "target", d, tmp_path / "art", r"weights \['fc.weight'\] hold NaN or infinite values; .* lower --lr")


def test_draft_passed_as_target_or_unfinished_training(ckpt, tmp_path):
    build_fails(ckpt / "draft", ckpt / "draft", tmp_path / "art", "is a DFlash draft, not a target; pass the target model as --target")
    unfinished = tmp_path / "run"
    (unfinished / "train_state").mkdir(parents=True)
    shutil.copy(ckpt / "draft" / "model.safetensors", unfinished / "train_state" / "state.safetensors")
    build_fails(ckpt / "target", unfinished, tmp_path / "art",
                f"holds only a train-draft resume state .* train-draft --resume {unfinished} --out {unfinished}")


def test_pickled_weights_refused(ckpt, tmp_path):
    t = copy_dir(ckpt / "target", tmp_path / "t")
    (t / "model.safetensors").rename(t / "pytorch_model.bin")
    build_fails(t, ckpt / "draft", tmp_path / "art", "only pickled weights")


def test_failure_after_export_started_leaves_nothing(ckpt, tmp_path):
    """A weight missing from the target is found while loading the export modules, i.e. after the
    temporary artifact directory exists: it must be removed, and an existing artifact kept intact."""
    from safetensors.numpy import load_file, save_file

    t = copy_dir(ckpt / "target", tmp_path / "t")
    state = load_file(str(t / "model.safetensors"))
    del state["model.layers.0.mlp.down_proj.weight"]
    save_file(state, str(t / "model.safetensors"))
    build_fails(t, ckpt / "draft", tmp_path / "art", r"missing \['model.layers.0.mlp.down_proj.weight'\]")


def test_failed_rebuild_keeps_the_old_artifact(qwen, ckpt, tmp_path):
    out = copy_dir(qwen.artifact, tmp_path / "art")
    before = (out / "manifest.json").read_text()
    d = edit_config(copy_dir(ckpt / "draft", tmp_path / "d"), lambda c: c["dflash_config"].update(mask_token_id=500))
    with pytest.raises(DFlashError, match="mask_token_id 500"):
        build(BuildOptions(str(ckpt / "target"), str(d), out, max_seq_len=32, quiet=True))
    assert (out / "manifest.json").read_text() == before and not rf.build_leftovers(out)
    assert runtime.load(out).generate([5, 6], max_new_tokens=3, stop_token_ids=[]).output_ids


def test_build_argument_errors(ckpt, tmp_path):
    with pytest.raises(DFlashError, match="--max-seq-len must be at least 2"):
        build(BuildOptions(str(ckpt / "target"), str(ckpt / "draft"), tmp_path / "art", max_seq_len=1, quiet=True))
    with pytest.raises(DFlashError, match="--dtype must be fp32 or fp16"):
        build(BuildOptions(str(ckpt / "target"), str(ckpt / "draft"), tmp_path / "art", dtype="bf16", quiet=True))
    rf.no_partial_output(tmp_path / "art")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(DFlashError, match="is not a dflash_export artifact; choose another --out"):
        build(BuildOptions(str(ckpt / "target"), str(ckpt / "draft"), busy, max_seq_len=32, quiet=True))
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and not rf.build_leftovers(busy)


# ---- runtime --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["", "   \n", []])
def test_empty_prompt(qwen, prompt):
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError, match="the prompt is empty"):
        sess.generate(prompt, max_new_tokens=4)


def test_prompt_beyond_capacity(qwen):
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError) as err:
        sess.generate([5] * 60, max_new_tokens=5)
    msg = str(err.value)
    assert "prompt (60 tokens) + max_new_tokens (5) = 65 exceeds" in msg
    assert "max_seq_len 64" in msg and "--max-seq-len 65" in msg


def test_manifest_of_another_version(qwen, tmp_path):
    art = copy_dir(qwen.artifact, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["version"] = 999
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DFlashError, match="manifest version 999, this runtime reads version 1") as err:
        runtime.load(art)
    assert "rebuild" in str(err.value)


def test_incomplete_artifacts(qwen, tmp_path):
    with pytest.raises(DFlashError, match="does not exist; create it with `python -m dflash_export build`"):
        runtime.load(tmp_path / "nothing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DFlashError, match="has no manifest.json"):
        runtime.load(empty)
    art = copy_dir(qwen.artifact, tmp_path / "art")
    (art / "draft.onnx").unlink()
    with pytest.raises(DFlashError, match="draft.onnx is missing; the artifact is incomplete"):
        runtime.load(art)
    art2 = copy_dir(qwen.artifact, tmp_path / "art2")
    (art2 / "manifest.json").write_text("{not json")
    with pytest.raises(DFlashError, match="is not valid JSON"):
        runtime.load(art2)
    with pytest.raises(DFlashError, match="unknown backend 'cuda-magic'"):
        runtime.load(qwen.artifact, backend="cuda-magic")


def test_text_without_tokenizer_or_template(qwen, tmp_path):
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError, match="has no chat template"):
        sess.generate("t5 t6", chat=True, max_new_tokens=2)
    art = copy_dir(qwen.artifact, tmp_path / "art")
    shutil.rmtree(art / "tokenizer")
    sess = runtime.load(art)
    with pytest.raises(DFlashError, match="has no tokenizer; pass token ids"):
        sess.generate("t5 t6", max_new_tokens=2)
    assert sess.generate([5, 6], max_new_tokens=2, stop_token_ids=[]).text is None
    with pytest.raises(DFlashError, match=r"has no tokenizer: drop them \(--stop\), or end replies at token ids with stop_token_ids"):
        sess.generate([5, 6], max_new_tokens=2, stop=["t7"])  # stop strings match text, which it cannot make


@pytest.mark.parametrize("threads", [0, -3, 1.5, True, "2", 2**31])
def test_bad_thread_count(qwen, threads):
    with pytest.raises(DFlashError, match=f"threads must be a positive integer up to 4096, or None for all cores; got {threads!r}"):
        runtime.load(qwen.artifact, threads=threads)


def test_numpy_thread_count_is_taken(qwen):
    import numpy as np

    with runtime.load(qwen.artifact, threads=np.int64(1)) as sess:
        assert sess.backend.threads == 1


def test_target_weights_that_do_not_match_the_config_are_refused_up_front(ckpt, tmp_path):
    """Names and shapes come from the safetensors headers, before any export starts (no weight is read)."""
    import numpy as np

    t = copy_dir(ckpt / "target", tmp_path / "t")
    rf._patch_safetensors(t / "model.safetensors",
                          lambda s: {k: v for k, v in s.items() if k != "model.layers.1.mlp.up_proj.weight"})
    msg = build_fails(t, ckpt / "draft", tmp_path / "art", r"weights do not match the architecture \(missing "
                      r"\['model.layers.1.mlp.up_proj.weight'\]")
    assert str(t) in msg
    t2 = copy_dir(ckpt / "target", tmp_path / "t2")
    rf._patch_safetensors(t2 / "model.safetensors", lambda s: {
        **s, "model.layers.0.self_attn.o_proj.weight": np.zeros((64, 32), np.float32)})
    build_fails(t2, ckpt / "draft", tmp_path / "art", r"model.layers.0.self_attn.o_proj.weight has shape \(64, 32\), "
                r"expected \(64, 96\)")


def test_integer_target_weight_is_refused(ckpt, tmp_path):
    import numpy as np

    t = copy_dir(ckpt / "target", tmp_path / "t")
    rf._patch_safetensors(t / "model.safetensors", lambda s: {
        **s, "model.layers.0.mlp.up_proj.weight": np.zeros(s["model.layers.0.mlp.up_proj.weight"].shape, np.int8)})
    build_fails(t, ckpt / "draft", tmp_path / "art", r"model.layers.0.mlp.up_proj.weight is stored as torch.int8, "
                r"not floating point")


@pytest.mark.parametrize("shard", [3, "../elsewhere.safetensors", "model.bin"])
def test_index_naming_odd_shards_is_refused(ckpt, tmp_path, shard):
    t = copy_dir(ckpt / "target", tmp_path / "t")
    (t / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    build_fails(t, ckpt / "draft", tmp_path / "art", r"model.safetensors.index.json names shards .*not .safetensors "
                r"files beside it")


def test_unwritable_output_location(ckpt, tmp_path):
    with pytest.raises(DFlashError, match=r"cannot write an artifact under /proc.*choose a writable --out"):
        build(BuildOptions(str(ckpt / "target"), str(ckpt / "draft"), Path("/proc/dflash-art"), max_seq_len=32, quiet=True))
