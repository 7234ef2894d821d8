"""`python -m dflash_export check`: parity of the exported graphs with the PyTorch modules.

It must pass on a faithful export (printing real error numbers), and FAIL (exit status 1) when a
graph is tampered with or the tolerance is absurdly tight.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from test_profiles import tiny_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(tmp_path_factory)


def _check(argv, capsys):
    from dflash_export.cli import main

    rc = main(["check", *argv])
    return rc, capsys.readouterr()


def test_check_passes_with_real_numbers(artifact, capsys):
    rc, out = _check([str(artifact)], capsys)
    assert rc == 0, out.out + out.err
    text = out.out
    assert "precision fp32" in text and "atol 0.0001" in text and "cosine >= 0.9999" in text
    rows = {(m[0], m[1]): m for m in re.findall(r"^(\w+)\s+(\w+)\s+\[[^\]]*\]\s+(\S+)\s+(\S+)\s+(\S+)\s+(ok|FAIL)", text, re.M)}
    for case in ("prefill", "verify"):
        for output in ("logits", "taps", "key_0", "value_3"):
            _, _, max_abs, max_rel, cosine, result = rows[(case, output)]
            assert result == "ok" and 0 <= float(max_abs) < 1e-4 and float(cosine) > 0.9999
    assert rows[("draft_step", "draft_hidden")][5] == "ok" and rows[("verify", "proposal_ids")][5] == "ok"
    assert any(float(rows[k][2]) > 0 for k in rows if rows[k][2] != "-")  # real, nonzero differences were measured
    assert re.search(r"^PASS: \d+ outputs within tolerance", text, re.M)


def test_check_fails_on_a_tampered_graph(artifact, tmp_path, capsys):
    import onnx
    from onnx import numpy_helper

    bad = tmp_path / "tampered"
    shutil.copytree(artifact, bad)
    model = onnx.load(str(bad / "target.onnx"))
    weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2]
    victim = max(weights, key=lambda i: int(np.prod(i.dims)))  # the biggest matrix
    arr = numpy_helper.to_array(victim).copy()
    arr[0] += 0.01  # one row nudged by 0.01
    victim.CopyFrom(numpy_helper.from_array(arr, victim.name))
    onnx.save(model, str(bad / "target.onnx"))
    rc, out = _check([str(bad)], capsys)
    assert rc == 1, out.out
    assert re.search(r"^FAIL: \d+ of \d+ outputs beyond tolerance", out.out, re.M)
    assert "draft_prefill/draft_hidden" not in out.out  # the untouched draft graph still passes


def test_check_fails_at_an_absurd_tolerance(artifact, capsys):
    rc, out = _check([str(artifact), "--atol", "0", "--rtol", "0"], capsys)
    assert rc == 1 and "FAIL" in out.out
    rc, out = _check([str(artifact), "--min-cosine", "1.000001"], capsys)
    assert rc == 1


def test_saved_reference_and_json(artifact, tmp_path, capsys):
    ref = tmp_path / "ref.npz"
    rc, out = _check([str(artifact), "--save-reference", str(ref), "--json"], capsys)
    assert rc == 0 and ref.is_file()
    live = json.loads(out.out)
    assert live["passed"] and live["precision"] == "fp32" and len(live["results"]) == 36
    rc, out = _check([str(artifact), "--reference", str(ref), "--json"], capsys)  # no PyTorch run needed
    assert rc == 0
    replay = json.loads(out.out)
    assert [r["max_abs"] for r in replay["results"]] == [r["max_abs"] for r in live["results"]]
    # a reference saved before the draft graph took proposal_rows: one clear error, not a shape error
    import numpy as np

    data = dict(np.load(ref, allow_pickle=False))
    meta = json.loads(bytes(data["meta"]).decode())
    for case in meta["cases"]:
        if case["graph"] == "draft":
            case["inputs"].remove("proposal_rows")
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    old = tmp_path / "old.npz"
    np.savez(old, **data)
    rc, out = _check([str(artifact), "--reference", str(old)], capsys)
    assert rc == 2 and "saved for an earlier build of this artifact" in out.err and "save it again" in out.err


def test_check_reports_user_errors(artifact, tmp_path, capsys):
    rc, out = _check([str(artifact), "--backend", "trt"], capsys)
    assert rc == 2 and "no TensorRT engines" in out.err
    rc, out = _check([str(artifact), "--prompt-len", "60"], capsys)
    assert rc == 2 and "does not fit" in out.err
    moved = tmp_path / "moved"
    shutil.copytree(artifact, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["sources"]["target"]["files"]["config.json"] = "0" * 64
    (moved / "manifest.json").write_text(json.dumps(manifest))
    rc, out = _check([str(moved)], capsys)
    assert rc == 2 and "differs from the file the artifact was exported from" in out.err
