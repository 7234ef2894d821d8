"""`check`: numerical parity of the exported graphs (or TensorRT engines) with the PyTorch modules.

    python -m dflash_export check DIR [--backend ort|trt|ort-cuda] [--atol A] [--rtol R] [--min-cosine C]

The reference is the exporter's own PyTorch modules in fp32, rebuilt from the source checkpoints
recorded in `manifest["sources"]` (their SHA-256 is verified first). Four cases follow the decoding
loop with teacher forcing (every input comes from the fp32 reference, so an early difference
cannot snowball): target PREFILL (a prompt, empty past), DRAFT_PREFILL (its taps as context),
target VERIFY (last token + the draft's block hidden states, on the prefill's K/V) and DRAFT_STEP
(a few verified rows on the first draft call's K/V). Both sides get exactly the same inputs (in
the graph's dtype); the artifact side runs through the runtime backend the decoding loop uses
(buffers, in-place K/V rows, profiles), inside Polygraphy's `Comparator` next to a runner of the
PyTorch modules' recorded outputs, and `SimpleCompareFunc` applies the tolerances.

Memory: the PyTorch side runs first and is freed before any graph loads, so the two never share memory.
The reference keeps the target's weights as stored (bf16 for most checkpoints) and upcasts each weight
to fp32 as it is used (the LM head a block of rows at a time); onnxruntime then loads one graph at a
time in a low-memory mode (`OrtBackend(low_memory=True)`). Peak RSS stays near one copy of the fp16
weights plus the fixed cost of torch (`scripts/export_memory.py --check` measures it).

Per output it prints the max absolute error, the max relative error (over elements whose
reference magnitude is at least the effective atol) and the cosine similarity. An output passes
when every element is within atol x max(1, RMS of the reference output) OR within rtol of the
reference (Polygraphy's elementwise rule, `SimpleCompareFunc`, with a per-output atol), and its
cosine similarity is >= min-cosine. atol is taken at the tensor's scale because hidden-state
outputs (taps) reach magnitudes in the thousands in real models, where an element's error follows
its row's magnitude, not its own. Token ids (next_ids, proposal_ids) must be equal wherever the
reference's top-2 logit margin exceeds `id_margin` (near-ties may flip at reduced precision); rows
of next_embeddings whose id flipped are skipped. Exit status 0 = pass, 1 = beyond tolerance,
2 = user error.

Default tolerances, by the precision that runs (the ONNX dtype for onnxruntime, the engine's
precision for TensorRT). They leave room above the errors seen on onnxruntime's CPU provider
(figures: docs/export.md#errors-seen-by-check-on-onnxruntimes-cpu-2026-11-30).

| precision | atol (x scale) | rtol | min cosine | id margin | why |
|---|---|---|---|---|---|
| fp32 | 1e-4 | 1e-3 | 0.9999 | 1e-3 | the same math in another kernel order (TF32 is off in fp32 engines) |
| fp16 | 1e-1 | 5e-2 | 0.99 | 0.25 | ~2.5x the fp16 error of a 30-layer model, for deeper models and TensorRT's own kernels; cosine 0.99 is the gate Edge-LLM uses |
| bf16 | 4e-1 | 1.5e-1 | 0.99 | 1.0 | bf16 keeps 3 fewer mantissa bits than fp16 (8x coarser) |

Without torch on the device: `check DIR --save-reference ref.npz` on the export host stores the
inputs and reference outputs; `check DIR --backend trt --reference ref.npz` on the device compares
against them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_export.check.cases import (
    Case,
    load_reference,
    reference_cases,
    run_module,
    save_reference,
)
from dflash_export.check.drift import check_args_drift, drift_for_check
from runtime.backends.base import View
from runtime.backends.ort import OrtBackend
from runtime.backends.profiles import output_shapes
from runtime.backends.select import make_backend as runtime_backend
from runtime.errors import DFlashError
from runtime.manifest import has_draft, load_manifest

# (a proposing draft's candidate ids too: compared where their rank is clear, `check_cases._rank_margins`)
ID_OUTPUTS = ("next_ids", "proposal_ids", "draft_top_ids")
# Outputs that are a lookup of an id output (compared on the rows where the ids agree).
ID_DEPENDENT = {"next_embeddings": "next_ids"}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    min_cosine: float
    id_margin: float


TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.9999, id_margin=1e-3),
    "fp16": Tolerance(atol=1e-1, rtol=5e-2, min_cosine=0.99, id_margin=0.25),
    "bf16": Tolerance(atol=4e-1, rtol=1.5e-1, min_cosine=0.99, id_margin=1.0),
}


@dataclass
class OutputResult:
    case: str
    output: str
    shape: tuple
    max_abs: float | None
    max_rel: float | None
    cosine: float | None
    passed: bool
    note: str = ""


@dataclass
class CheckReport:
    artifact: str
    backend: str
    precision: str
    tolerance: Tolerance
    results: list[OutputResult]
    seconds: float
    reference: str = "the PyTorch modules in fp32"

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict:
        return {
            "artifact": self.artifact, "backend": self.backend, "precision": self.precision, "passed": self.passed,
            "tolerance": self.tolerance.__dict__, "seconds": self.seconds, "reference": self.reference,
            "results": [r.__dict__ | {"shape": list(r.shape)} for r in self.results],
        }


# ---- Polygraphy runners ------------------------------------------------------------------------------
def _runner_classes():
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class _IoRunner(BaseRunner):
        def __init__(self, manifest, graph, name):
            super().__init__(name=name, prefix=name)
            self.manifest, self.graph = manifest, graph

        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for t in self.manifest["io"][self.graph]["inputs"]:
                meta.add(t["name"], np.dtype(t["dtype"]), [d if isinstance(d, int) else str(d) for d in t["shape"]])
            return meta

    class RecordedRunner(_IoRunner):
        """Returns the fp32 reference outputs computed by the PyTorch modules (live or saved), in case order."""

        def __init__(self, manifest, graph, cases, name):
            super().__init__(manifest, graph, name)
            self.cases, self.i = cases, 0

        def infer_impl(self, feed_dict):
            case = self.cases[self.i]
            self.i += 1
            self.inference_time = 0.0
            return OrderedDict(case.ref)

    class TorchRunner(_IoRunner):
        """Runs a PyTorch module (fp32, CPU) on the feed."""

        def __init__(self, manifest, graph, module, name):
            super().__init__(manifest, graph, name)
            self.module = module

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            outs = run_module(self.module, feed_dict)
            names = [t["name"] for t in self.manifest["io"][self.graph]["outputs"]]
            res = OrderedDict((n, o.astype(np.float32) if o.dtype.kind == "f" else o) for n, o in zip(names, outs))
            self.inference_time = time.perf_counter() - t0
            return res

    class BackendRunner(_IoRunner):
        """Runs the graph through a runtime backend the way the decoding loop binds it: past K/V and the
        new rows in ONE buffer (new rows at row P), every other tensor in its own buffer."""

        def __init__(self, manifest, graph, backend, name):
            super().__init__(manifest, graph, name)
            self.backend = backend

        def infer_impl(self, feed_dict):
            be, graph = self.backend, self.graph
            if graph == "target" and feed_dict["uniform"].size == 0 and not be.greedy_without_uniforms:
                # a greedy case recorded without uniforms, on an engine that needs them (same result)
                feed_dict = OrderedDict(feed_dict)
                proposals = feed_dict["proposal_ids" if "proposal_ids" in feed_dict else "draft_hidden"]
                feed_dict["uniform"] = np.zeros(proposals.shape[0] + 1, np.float32)
            shapes = {n: tuple(a.shape) for n, a in feed_dict.items()}
            outs = output_shapes(self.manifest, graph, shapes)
            out_dtype = {t["name"]: np.dtype(t["dtype"]) for t in self.manifest["io"][graph]["outputs"]}
            ins, views = {}, {}
            for name, arr in feed_dict.items():
                if name.startswith("past_"):
                    new = name[len("past_"):]
                    p, n = arr.shape[0], outs[new][0]
                    buf = be.alloc(arr.dtype, p + n, arr.shape[1:])
                    ins[name], views[new] = buf.rows(0, p), buf.rows(p, n)
                else:
                    # flat, at least one element: an empty input may have no row at all (a tree_bias [0, 0])
                    ins[name] = View(be.alloc(arr.dtype, max(1, arr.size)), 0, arr.shape)
                if arr.size:
                    be.write(ins[name], arr)
            for name, shape in outs.items():
                if name not in views:
                    views[name] = be.alloc(out_dtype[name], max(1, shape[0]), shape[1:]).rows(0, shape[0])
            t0 = time.perf_counter()
            be.run(graph, ins, views)
            res = OrderedDict()
            for name in outs:
                arr = be.read(views[name])
                res[name] = arr.astype(np.float32) if arr.dtype.kind == "f" else arr
            self.inference_time = time.perf_counter() - t0
            return res

    return RecordedRunner, TorchRunner, BackendRunner


# ---- comparison ------------------------------------------------------------------------------------------
def _stats(out: np.ndarray, ref: np.ndarray, atol: float) -> tuple[float, float, float | None]:
    a, b = out.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    if a.size == 0:
        return 0.0, 0.0, None
    diff = np.abs(a - b)
    big = np.abs(b) >= atol
    max_rel = float(np.max(diff[big] / np.abs(b[big]))) if big.any() else 0.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cosine = 1.0 if na == 0 and nb == 0 else float(np.dot(a, b) / (na * nb)) if na and nb else 0.0
    return float(np.max(diff)), max_rel, cosine


def _accuracy_verdicts(acc, pair_names) -> list[dict]:
    """Per iteration {output: bool} from Comparator.compare_accuracy (AccuracyResults or AccuracyResult)."""
    if not hasattr(acc, "items"):  # polygraphy >= 0.53: AccuracyResults, one per compare func
        acc = acc[0]
    for pair, iterations in acc.items():
        if tuple(pair) == tuple(pair_names):
            return [{k: bool(v) for k, v in it.items()} for it in iterations]
    raise DFlashError(f"polygraphy returned no comparison for {pair_names}")


def compare(manifest: dict, cases: list[Case], backend, backend_name: str, tol: Tolerance, modules=None,
            verbose: bool = False) -> list[OutputResult]:
    """Run every case through `backend` and the reference inside Polygraphy's Comparator and judge it."""
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    try:  # polygraphy >= 0.53 (CompareFunc.simple is deprecated there)
        from polygraphy.comparator import SimpleCompareFunc as simple_compare
    except ImportError:
        from polygraphy.comparator import CompareFunc

        simple_compare = CompareFunc.simple

    RecordedRunner, TorchRunner, BackendRunner = _runner_classes()
    quiet = contextlib.nullcontext() if verbose or not hasattr(G_LOGGER, "verbosity") else G_LOGGER.verbosity(G_LOGGER.CRITICAL)
    results: list[OutputResult] = []
    for graph in ("target", "draft", "mtp"):
        gcases = [c for c in cases if c.graph == graph]
        if not gcases:
            continue
        if modules is not None and graph != "mtp":  # (the head's reference is recorded with the cases)
            ref_runner = TorchRunner(manifest, graph, modules[0] if graph == "target" else modules[1], f"pytorch-fp32-{graph}")
        else:
            ref_runner = RecordedRunner(manifest, graph, gcases, f"reference-fp32-{graph}")
        runner = BackendRunner(manifest, graph, backend, f"{backend_name}-{graph}")
        scale = _output_scales(gcases)
        compare_func = simple_compare(
            atol={"": tol.atol, **{n: tol.atol * k for n, k in scale.items()}}, rtol=tol.rtol, check_shapes=True,
            find_output_func=lambda name, index, result: [] if name in ID_OUTPUTS or name in ID_DEPENDENT else [name],
        )
        with quiet:
            run_results = Comparator.run([runner, ref_runner], data_loader=[c.feed for c in gcases])
            acc = Comparator.compare_accuracy(run_results, compare_func=compare_func)
        verdicts = _accuracy_verdicts(acc, (runner.name, ref_runner.name))
        for i, case in enumerate(gcases):
            got, ref = run_results[runner.name][i], run_results[ref_runner.name][i]
            for name in ref.keys():
                out, want = np.asarray(got[name]), np.asarray(ref[name])
                if name in ID_OUTPUTS:
                    results.append(_id_result(case, name, out, want, tol))
                    continue
                note = ""
                if name in ID_DEPENDENT:  # rows of a flipped (near-tie) id embed another token: skip them
                    ids = ID_DEPENDENT[name]
                    same = np.asarray(got[ids]) == np.asarray(ref[ids])
                    if out.shape != want.shape or same.shape != want.shape[:1]:
                        results.append(OutputResult(case.name, name, tuple(want.shape), None, None, None, False,
                                                    f"shape {list(out.shape)}"))
                        continue
                    if not same.all():
                        note = f"{int((~same).sum())} rows of flipped ids skipped"
                    out, want = out[same], want[same]
                    verdict = _elementwise_ok(out, want, tol.atol * scale.get(name, 1.0), tol.rtol)
                else:
                    verdict = verdicts[i].get(name, False)
                max_abs, max_rel, cosine = _stats(out, want, tol.atol * scale.get(name, 1.0))
                ok = verdict and (cosine is None or cosine >= tol.min_cosine)
                results.append(OutputResult(case.name, name, tuple(np.asarray(ref[name]).shape), max_abs, max_rel, cosine,
                                            bool(ok), note))
    return results


def _output_scales(cases: list[Case]) -> dict[str, float]:
    """Per float output, max(1, RMS of the reference) over the cases: atol is applied at the tensor's
    scale (hidden-state outputs such as taps reach magnitudes in the thousands, where an element's
    error follows its row's magnitude rather than its own)."""
    scale: dict[str, float] = {}
    for case in cases:
        for name, ref in case.ref.items():
            if ref.dtype.kind == "f" and ref.size:
                rms = float(np.sqrt(np.mean(np.square(ref.astype(np.float64)))))
                scale[name] = max(scale.get(name, 1.0), rms)
    return scale


def _elementwise_ok(out: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> bool:
    """Polygraphy's elementwise rule: every element within atol or within rtol of the reference."""
    diff = np.abs(out.astype(np.float64) - want.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = diff / np.abs(want.astype(np.float64))
    return not bool(np.any((diff > atol) & ~(rel <= rtol)))


def _id_result(case: Case, name: str, out: np.ndarray, want: np.ndarray, tol: Tolerance) -> OutputResult:
    if out.shape != want.shape:
        return OutputResult(case.name, name, tuple(want.shape), None, None, None, False, f"shape {list(out.shape)}")
    margins = case.margins.get(name, np.full(want.shape, np.inf))
    differ = out != want
    decided = margins > tol.id_margin
    bad = int(np.sum(differ & decided))
    ties = int(np.sum(differ & ~decided))
    note = f"{int(np.sum(~differ))}/{want.size} equal" + (f", {ties} near-tie flips allowed" if ties else "")
    return OutputResult(case.name, name, tuple(want.shape), None, None, None, bad == 0, note)


def make_backend(name: str, artifact_dir: Path, manifest: dict, graphs: tuple[str, ...] = ("target", "draft")):
    """The runtime backend `name` for the check (the same classes `runtime.load` uses); onnxruntime on
    the CPU loads only `graphs`, in its low-memory mode, so checking a large graph holds its weights
    about once."""

    if name == "ort":

        # INT4 weights: the fused MatMulNBits computes in fp32 whatever the runtime's default is
        return OrtBackend(Path(artifact_dir), manifest, low_memory=True, graphs=graphs, int4_accuracy_level=1)
    return runtime_backend(name, Path(artifact_dir), manifest, None)


def run_check(
    artifact_dir: str | Path,
    backend: str = "ort",
    atol: float | None = None,
    rtol: float | None = None,
    min_cosine: float | None = None,
    id_margin: float | None = None,
    prompt_len: int | None = None,
    seed: int = 0,
    reference: str | Path | None = None,
    save_reference_to: str | Path | None = None,
    verbose: bool = False,
) -> CheckReport:
    """Compare the artifact's graphs (or engines) on `backend` with the fp32 PyTorch modules.

    Raises:
        DFlashError: a bad artifact, missing source checkpoints, an unavailable backend.
    """

    t0 = time.perf_counter()
    artifact_dir = Path(artifact_dir)
    manifest = load_manifest(artifact_dir)
    if backend == "trt":
        if not manifest.get("trt"):
            raise DFlashError(f"{artifact_dir} has no TensorRT engines to check; build them with `python -m dflash_export engine {artifact_dir}`")
        precision = manifest["trt"]["precision"]
    else:
        precision = manifest["dtype"]
    base = TOLERANCES[precision]
    tol = Tolerance(
        atol=base.atol if atol is None else float(atol),
        rtol=base.rtol if rtol is None else float(rtol),
        min_cosine=base.min_cosine if min_cosine is None else float(min_cosine),
        id_margin=base.id_margin if id_margin is None else float(id_margin),
    )
    if reference is not None:
        cases = load_reference(Path(reference), manifest)
    else:
        # the PyTorch modules run first and are freed before the graphs load: the two never share memory
        cases = reference_cases(artifact_dir, manifest, prompt_len, seed)
        if save_reference_to is not None:
            save_reference(Path(save_reference_to), cases, manifest)
        gc.collect()
    # onnxruntime loads one graph at a time (the other engines need both for their shared buffers)
    graphs = (("target", "draft") if has_draft(manifest) else ("target",)) + (("mtp",) if "mtp" in manifest else ())
    parts = [(g,) for g in graphs] if backend == "ort" else [graphs]
    results = []
    for graphs in parts:
        be = make_backend(backend, artifact_dir, manifest, graphs)
        try:
            results += compare(manifest, [c for c in cases if c.graph in graphs], be, backend, tol, None, verbose)
        finally:
            if hasattr(be, "close"):
                be.close()
            del be
            gc.collect()
    return CheckReport(str(artifact_dir), backend, precision, tol, results, round(time.perf_counter() - t0, 1),
                       _reference_words(manifest))


def _reference_words(manifest: dict) -> str:
    """What the report compares with: for an INT4 artifact, the model its INT4 weights define."""
    quant = manifest.get("quantization")
    if not quant:
        return "the PyTorch modules in fp32"
    method = "AWQ-scaled, " if quant.get("method") == "awq" else ""
    return (f"the PyTorch modules in fp32 on the dequantized INT4 weights ({method}block {quant['block']}), "
            "the graph's INT4 kernels computing in fp32 (accuracy level 1; the runtime's default may differ: "
            "--drift-reference shows what that costs)")


def format_report(rep: CheckReport) -> str:
    t = rep.tolerance
    lines = [
        f"check {rep.artifact}: backend {rep.backend}, precision {rep.precision}; reference: {rep.reference}",
        f"tolerance: per element atol {t.atol:g} x max(1, RMS of the reference output) or rtol {t.rtol:g}; "
        f"cosine >= {t.min_cosine:g}; "
        f"ids equal where the top-2 logit margin > {t.id_margin:g}",
        f"{'case':<14}{'output':<17}{'shape':<16}{'max_abs':>10}{'max_rel':>10}{'cosine':>11}  result",
    ]

    def num(x, fmt):
        width = int(fmt.split(".")[0])
        return f"{'-':>{width}}" if x is None else format(x, fmt)

    for r in rep.results:
        lines.append(
            f"{r.case:<14}{r.output:<17}{str(list(r.shape)):<16}{num(r.max_abs, '10.3g')}{num(r.max_rel, '10.3g')}"
            f"{num(r.cosine, '11.7f')}  {'ok' if r.passed else 'FAIL'}{'  ' + r.note if r.note else ''}"
        )
    bad = [r for r in rep.results if not r.passed]
    worst = max((r.max_abs for r in rep.results if r.max_abs is not None), default=0.0)
    lines.append(
        f"PASS: {len(rep.results)} outputs within tolerance (worst max_abs {worst:.3g}) in {rep.seconds}s" if not bad
        else f"FAIL: {len(bad)} of {len(rep.results)} outputs beyond tolerance: "
             + ", ".join(f"{r.case}/{r.output}" for r in bad)
    )
    return "\n".join(lines)


def cmd_check(args) -> int:

    check_args_drift(args)
    rep = run_check(
        args.artifact, backend=args.backend, atol=args.atol, rtol=args.rtol, min_cosine=args.min_cosine,
        id_margin=args.id_margin, prompt_len=args.prompt_len, seed=args.seed, reference=args.reference,
        save_reference_to=args.save_reference, verbose=args.verbose,
    )
    drift = drift_for_check(args) if args.drift_reference else None
    if args.json:
        print(json.dumps({**rep.to_dict(), **({"drift": drift.to_dict()} if drift else {})}))
    else:
        print(format_report(rep) + (f"\n{drift.line()} (reference {args.drift_reference})" if drift else ""))
    return 0 if rep.passed else 1


def register(subparsers) -> None:
    """Add the `check` subcommand."""
    p = subparsers.add_parser("check", help="compare the exported graphs (or TensorRT engines) with the PyTorch modules")
    p.add_argument("artifact", help="artifact directory written by build")
    p.add_argument("--backend", default="ort", choices=["ort", "trt", "ort-cuda"], help="what runs the artifact (default ort)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance, times max(1, RMS of each output) (default: fp32 1e-4, fp16 0.1, bf16 0.4)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: fp32 1e-3, fp16 0.05, bf16 0.15)")
    p.add_argument("--min-cosine", type=float, default=None, help="least cosine similarity per output (default fp32 0.9999, else 0.99)")
    p.add_argument("--id-margin", type=float, default=None, help="token ids must match where the reference top-2 logit margin exceeds this")
    p.add_argument("--prompt-len", type=int, default=None, help="prefill length (default min(13, max_seq_len - block))")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--reference", default=None, help="compare against a reference saved by --save-reference (no torch needed)")
    p.add_argument("--save-reference", default=None, help="also save the inputs and fp32 reference outputs to this .npz")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="show Polygraphy's own comparison log")
    p.add_argument("--drift-reference", default=None, metavar="DIR",
                   help="also report the drift from this full-precision artifact of the same model (quantized "
                        "artifacts): teacher-forced top-1 agreement and mean KL on held-out prompts")
    p.add_argument("--drift-prompts", default=None, help="JSONL prompts for the drift (default models/prompts/eval.jsonl)")
    p.add_argument("--drift-per-category", type=int, default=None, help="drift prompts per category (default 1)")
    p.add_argument("--drift-tokens", type=int, default=None, help="teacher-forced positions per prompt (default 48)")
    p.set_defaults(func=cmd_check)


if __name__ == "__main__":
    sys.exit(print("use: python -m dflash_export check DIR ...") or 2)
