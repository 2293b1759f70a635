#!/usr/bin/env bash
# The one command for a lent GPU machine (README, "GPU checks"): from a bare image
# with torch, triton and cuda-bindings but no pyzmq and no network, it installs the
# carried wheels and the project, runs bench/gpu_check.py and `pytest -m gpu`, and
# writes logs and JSON under $OUT. Run from the repository root:
#
#     bash bench/gpu_run.sh
#
# Inputs (environment): OUT (default bench/results/gpu_run), PYTHON (default
# python3), WHEELS (default .whl: the carried wheel folder; see README for the
# `pip download` line). Nothing is fetched: every pip call is --no-index.
# Time: under 8 minutes (install ~20 s, checks <= 290 s, pytest <= 160 s).
# Exit status: 0 when every check and test passed, 1 otherwise, 2 when the
# install failed (then nothing ran).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-bench/results/gpu_run}"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/kvd-site}"
CHECK_BUDGET_S=270
CHECK_TIMEOUT_S=120
PYTEST_BUDGET_S=150
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

note() { echo "gpu_run: $*" | tee -a "$OUT/summary.txt"; }

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    "$PYTHON" -VV
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    "$PYTHON" -m pip list 2>/dev/null | grep -i -E "^(torch|triton|cuda-|setuptools|pyzmq|msgpack|transformers|numpy) " || true
} >"$OUT/env.txt" 2>&1
: >"$OUT/summary.txt"

# 1. Wheels the image lacks (pyzmq; setuptools >= 77 for the build), into a folder of their own.
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl >>"$OUT/install.log" 2>&1 || { note "installing $WHEELS failed"; exit 2; }
fi
# 2. The project itself, editable, without network or build isolation.
"$PYTHON" - <<'EOF' >>"$OUT/install.log" 2>&1 || { note "setuptools >= 77 is needed (carry its wheel)"; exit 2; }
import setuptools
major = int(setuptools.__version__.split(".")[0])
print("setuptools", setuptools.__version__)
raise SystemExit(0 if major >= 77 else 1)
EOF
# Editable into the interpreter's environment; where that is read-only, a plain copy into $SITE.
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
    || "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
        >>"$OUT/install.log" 2>&1 \
    || { note "installing the project failed (see install.log)"; exit 2; }
"$PYTHON" -c "import zmq, kvdaemon.client, kvdaemon.cuda_vmm; print('imports ok, pyzmq', zmq.__version__)" \
    >>"$OUT/install.log" 2>&1 || note "kvdaemon.client does not import (see install.log): daemon checks will fail"

# 3. The checks (each in its own process), then the tests marked gpu.
timeout -k 10 "$((CHECK_BUDGET_S + 20))" "$PYTHON" bench/gpu_check.py --timeout "$CHECK_TIMEOUT_S" \
    --budget "$CHECK_BUDGET_S" --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
checks=${PIPESTATUS[0]}
timeout -k 10 "$PYTEST_BUDGET_S" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
tests=${PIPESTATUS[0]}

grep -E "^SUMMARY" "$OUT/gpu_check.log" | tee -a "$OUT/summary.txt" || note "gpu_check wrote no summary (exit $checks)"
tail -n 1 "$OUT/pytest_gpu.log" | sed 's/^/pytest -m gpu: /' | tee -a "$OUT/summary.txt"
note "gpu_check exit $checks, pytest exit $tests"
[ "$checks" -eq 0 ] && [ "$tests" -eq 0 ]
