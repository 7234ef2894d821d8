#!/usr/bin/env bash
# Device check: TensorRT engines for a tiny model and the embedded SmolLM2 pair, `check` against the
# PyTorch modules, and `generate` compared token for token with the onnxruntime CPU backend.
#
#   scripts/gpu_check.sh [WORK_DIR]        (default: a new temporary directory)
#
# Needs: an NVIDIA GPU, TensorRT 10/11 Python bindings, polygraphy, and the exporter's dependencies
# (torch, transformers, ...: `pip install -e ".[export]"`). On a Jetson without torch, export on the
# host, copy the artifacts, and run only the engine/check/generate steps (docs/jetson.md).
# Environment: PY (python, default `python`), SMOL_SEQ (SmolLM2 max_seq_len, default 512),
# SKIP_SMOL=1 (tiny model only). Exit status: 0 when every row passed.
set -uo pipefail

PY=${PY:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d -t dflash-gpu-check-XXXXXX)}
SMOL_SEQ=${SMOL_SEQ:-512}
mkdir -p "$WORK"
cd "$ROOT"
ROWS=()
FAILED=0

say() { printf '\n== %s\n' "$*" >&2; }

$PY - <<'EOF' || { echo "gpu_check: nothing was run" >&2; exit 2; }
import sys
from dflash_export.trt.engine import require_tensorrt
from runtime.errors import DFlashError
try:
    trt, gpu = require_tensorrt()
except DFlashError as exc:
    sys.exit(f"error: {exc}")
print(f"TensorRT {trt.__version__} on {gpu['name']} (compute capability {gpu['compute_capability']})")
EOF

# One row: build engines for ARTIFACT at PRECISION, check trt and ort, compare generate (trt vs ort CPU).
run_row() {
  local name=$1 art=$2 precision=$3 ids=$4 block=$5 expect_equal=$6
  local engine_ok=no check_trt=FAIL check_ort=FAIL gen=FAIL tps_trt=- tps_ort=-
  say "$name: engines ($precision)"
  if $PY -m dflash_export engine "$art" --precision "$precision"; then engine_ok=yes; fi
  say "$name: check --backend ort"
  $PY -m dflash_export check "$art" --backend ort > "$WORK/$name.check_ort.txt" 2>&1 && check_ort=ok
  tail -n 1 "$WORK/$name.check_ort.txt" >&2
  if [ "$engine_ok" = yes ]; then
    say "$name: check --backend trt"
    $PY -m dflash_export check "$art" --backend trt > "$WORK/$name.check_trt.txt" 2>&1 && check_trt=ok
    tail -n 1 "$WORK/$name.check_trt.txt" >&2
    say "$name: generate, trt vs ort (CPU)"
    for be in trt ort; do
      $PY -m dflash_export generate "$art" --prompt-ids "$ids" --max-new-tokens 48 --block-size "$block" \
        --backend "$be" --json > "$WORK/$name.gen_$be.json" 2> "$WORK/$name.gen_$be.err" || true
    done
    read -r gen tps_trt tps_ort < <($PY - "$WORK/$name.gen_trt.json" "$WORK/$name.gen_ort.json" "$expect_equal" <<'EOF'
import json, sys
try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except Exception:
    print("FAIL - -"); sys.exit()
x, y = a["output_ids"], b["output_ids"]
first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None if len(x) == len(y) else min(len(x), len(y)))
if first is None:
    verdict = "equal"
elif sys.argv[3] == "equal":
    verdict = f"FAIL(diverge@{first})"
else:  # reduced precision: a near-tie flip may change the continuation; report where
    verdict = f"diverge@{first}"
print(verdict, f"{a['tokens_per_s']:.1f}", f"{b['tokens_per_s']:.1f}")
EOF
)
  fi
  ROWS+=("$(printf '%-22s %-6s %-7s %-9s %-9s %-18s %9s %9s' "$name" "$precision" "$engine_ok" "$check_trt" "$check_ort" "$gen" "$tps_trt" "$tps_ort")")
  case "$engine_ok/$check_trt/$check_ort/$gen" in
    yes/ok/ok/equal|yes/ok/ok/diverge@*) ;;
    *) FAILED=1 ;;
  esac
}

say "tiny Qwen3 pair (random weights)"
# the test suite's tiny pair (GQA 4:2, head_dim 24 != hidden / heads, a tap on the last layer): tests/tiny_models.py
PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" $PY - "$WORK" <<'EOF'
import sys
from pathlib import Path
from tiny_models import make_draft, make_target
work = Path(sys.argv[1])
t = make_target(work / "tiny_target")
make_draft(work / "tiny_draft", t)
EOF
$PY -m dflash_export build --target "$WORK/tiny_target" --draft "$WORK/tiny_draft" --out "$WORK/tiny_fp32" --max-seq-len 128
$PY -m dflash_export build --target "$WORK/tiny_target" --draft "$WORK/tiny_draft" --out "$WORK/tiny_fp16" --max-seq-len 128 --dtype fp16
run_row tiny-fp32 "$WORK/tiny_fp32" fp32 "5,17,33,8,61,2,9" 8 equal
run_row tiny-fp16-strong "$WORK/tiny_fp16" fp16 "5,17,33,8,61,2,9" 8 any

if [ "${SKIP_SMOL:-0}" != 1 ]; then
  say "embedded SmolLM2-135M-Instruct + its draft"
  $PY -m dflash_export build --out "$WORK/smol_fp16" --dtype fp16 --max-seq-len "$SMOL_SEQ"
  run_row smollm2-fp16-strong "$WORK/smol_fp16" fp16 "1,9690,198,2683,359,253,1382" 16 any
  if $PY -c "import tensorrt as t, sys; sys.exit(int(t.__version__.split('.')[0]) >= 11)"; then
    $PY -m dflash_export build --out "$WORK/smol_fp32" --dtype fp32 --max-seq-len "$SMOL_SEQ"
    run_row smollm2-fp32 "$WORK/smol_fp32" fp32 "1,9690,198,2683,359,253,1382" 16 equal
    cp -r "$WORK/smol_fp32" "$WORK/smol_fp32_weak16"
    run_row smollm2-weak-fp16 "$WORK/smol_fp32_weak16" fp16 "1,9690,198,2683,359,253,1382" 16 any
  fi
fi

printf '\n%-22s %-6s %-7s %-9s %-9s %-18s %9s %9s\n' artifact engine built check_trt check_ort "generate trt=ort" "tok/s trt" "tok/s ort"
printf '%s\n' "${ROWS[@]}"
echo "(logs and JSON in $WORK)"
exit $FAILED
