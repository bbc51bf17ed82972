#!/usr/bin/env bash
# One prepared CUDA check for a session that is lent a GPU (see README "What works"):
# the CUDA tests, then the core speed benchmark on the device. Writes logs to ${OUT:-gpu-check}/.
# Usage (repository root; .venv from `make test`, or python3 + wheels from scripts/gpu_wheels.sh):
#   scripts/gpu_check.sh [MNIST_DIR]
# At most about 9 minutes (three steps of at most 3 minutes each).
set -uo pipefail
MNIST_DIR=${1:-../shared/data/mnist}
OUT=${OUT:-gpu-check}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"
# every test that names CUDA (they skip without a device; here they must run)
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -rs -k "cuda" 2>&1 | tee "$OUT/tests_cuda.txt" | tail -5
if [ -d "$MNIST_DIR" ]; then
  timeout 150 "$PY" benchmarks/bench_core.py --device cuda --data-dir "$MNIST_DIR" --block 3 --repeats 3 \
    2>&1 | tee "$OUT/bench_core_cuda.txt" | tail -16
else
  echo "no MNIST at $MNIST_DIR: bench_core skipped" | tee "$OUT/bench_core_cuda.txt"
fi
if [ -d "$MNIST_DIR" ]; then
  timeout 120 "$PY" benchmarks/bench_hypernet.py --task speed --device cuda --data-dir "$MNIST_DIR" --epochs 3 --fused \
    --num-flows 0 8 2>&1 | tee "$OUT/bench_hypernet_cuda.txt" | tail -8
fi
# the whole suite on this machine's torch (CPU paths; pytest-xdist where installed)
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 120 "$PY" -m pytest -q -p no:cacheprovider $XDIST 2>&1 | tee "$OUT/tests_all.txt" | tail -5
