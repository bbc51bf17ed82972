#!/usr/bin/env bash
# One prepared CUDA check for a session that is lent a GPU (see README "What works"):
# the CUDA tests, the core and Hypernet speed benchmarks on the device, the full Fashion-MNIST
# speed rows (MLP and CNN: MAP, references, guides; benchmarks/bench_fmnist_speed.py), then the
# whole suite on the CPU. Writes logs to ${OUT:-gpu-check}/.
# Usage (repository root; .venv from `make test`, or python3 + wheels from scripts/gpu_wheels.sh):
#   scripts/gpu_check.sh [MNIST_DIR]
# Environment: OUT (log folder), PY (python), FMNIST_DIR (Fashion-MNIST IDX files; default
# $PYRO_BNN_FASHION_MNIST, else /usr/share/datasets/fashion-mnist), STEPS (the steps to run, any of
# "tests core hypernet fmnist compile graph ops suite"; default all).
# Each step has its own timeout; all seven take up to ~18 minutes, more than one 10-minute device
# call: run them as two calls, e.g. STEPS="tests core hypernet compile" then STEPS="fmnist suite".
# "compile": pb.fit(compile=True) against eager on CUDA (MLP, MeanField and Hypernet-8), an epoch
# of a fit without its set-up ("fit epoch", "fitc epoch").
# Without a CUDA device the CUDA steps say so and are skipped; the suite step still runs.
set -uo pipefail
MNIST_DIR=${1:-../shared/data/mnist}
OUT=${OUT:-gpu-check}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
FMNIST_DIR=${FMNIST_DIR:-${PYRO_BNN_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}}
STEPS=${STEPS:-tests core hypernet fmnist compile graph ops suite}
mkdir -p "$OUT"
want() { [[ " $STEPS " == *" $1 "* ]]; }
"$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then CUDA=1; else CUDA=0; fi
[ "$CUDA" = 1 ] || echo "no CUDA device: the CUDA steps are skipped" | tee "$OUT/no_cuda.txt"
# every test that names CUDA (they skip without a device; here they must run)
if want tests && [ "$CUDA" = 1 ]; then
  XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4 -p no:benchmark")
  timeout ${TESTS_TIMEOUT:-200} "$PY" -m pytest -q -p no:cacheprovider -rs $XDIST -k "${TESTS_K:-cuda}" 2>&1 \
    | tee "$OUT/tests_cuda.txt" | grep -v "^SKIPPED\|^\s*$" | tail -40
fi
if want core && [ "$CUDA" = 1 ]; then
  if [ -d "$MNIST_DIR" ]; then
    timeout 150 "$PY" benchmarks/bench_core.py --device cuda --data-dir "$MNIST_DIR" --block 3 --repeats 3 \
      2>&1 | tee "$OUT/bench_core_cuda.txt" | tail -16
  else
    echo "no MNIST at $MNIST_DIR: bench_core skipped" | tee "$OUT/bench_core_cuda.txt"
  fi
fi
if want hypernet && [ "$CUDA" = 1 ]; then
  if [ -d "$MNIST_DIR" ]; then
    timeout 120 "$PY" benchmarks/bench_hypernet.py --task speed --device cuda --data-dir "$MNIST_DIR" --epochs 3 --fused \
      --num-flows 0 8 2>&1 | tee "$OUT/bench_hypernet_cuda.txt" | tail -8
  else
    echo "no MNIST at $MNIST_DIR: bench_hypernet skipped" | tee "$OUT/bench_hypernet_cuda.txt"
  fi
fi
# full Fashion-MNIST speed rows (issue 27): MAP, plain-PyTorch references, guide loop, pb.fit
if want fmnist && [ "$CUDA" = 1 ]; then
  if [ -d "$FMNIST_DIR" ]; then
    for arch in mlp cnn; do
      PYRO_BNN_FASHION_MNIST="$FMNIST_DIR" timeout 120 "$PY" benchmarks/bench_fmnist_speed.py --device cuda \
        --arch "$arch" --steps 200 --repeats 3 --out "$OUT/fmnist_speed_cuda.jsonl" \
        2>&1 | tee "$OUT/fmnist_speed_${arch}_cuda.txt" | tail -16
    done
  else
    echo "no Fashion-MNIST at $FMNIST_DIR: the Fashion-MNIST speed rows skipped" | tee "$OUT/fmnist_speed_cuda.txt"
  fi
fi
# the compiled step on CUDA (issue 27): pb.fit(compile=True) beside the eager fit and the references
if want compile && [ "$CUDA" = 1 ]; then
  if [ -d "$FMNIST_DIR" ]; then
    PYRO_BNN_FASHION_MNIST="$FMNIST_DIR" timeout 240 "$PY" benchmarks/bench_fmnist_speed.py --device cuda \
      --arch mlp --guides meanfield hypernet8 --steps 200 --repeats 3 --fit-epoch --compile --no-fit-setup \
      --out "$OUT/fmnist_compile_cuda.jsonl" 2>&1 | grep -v "^W" | tee "$OUT/fmnist_compile_cuda.txt" | tail -14
  else
    echo "no Fashion-MNIST at $FMNIST_DIR: the compile rows skipped" | tee "$OUT/fmnist_compile_cuda.txt"
  fi
fi
# pb.fit(cuda_graph=True) against the eager fit, the references and the MAP step on CUDA (issue 27):
# the marginal epoch of a fit ("fitg epoch") beside the eager one ("fit epoch")
if want graph && [ "$CUDA" = 1 ]; then
  if [ -d "$FMNIST_DIR" ]; then
    for arch in ${GRAPH_ARCHS:-mlp}; do
      PYRO_BNN_FASHION_MNIST="$FMNIST_DIR" timeout ${GRAPH_TIMEOUT:-150} "$PY" benchmarks/bench_fmnist_speed.py \
        --device cuda --arch "$arch" --guides ${GRAPH_GUIDES:-meanfield hypernet8} --steps 200 --repeats 3 \
        --fit-epoch --cuda-graph --no-fit-setup --out "$OUT/fmnist_graph_cuda.jsonl" 2>&1 | grep -v "^W" \
        | tee "$OUT/fmnist_graph_${arch}_cuda.txt" | tail -16
    done
  else
    echo "no Fashion-MNIST at $FMNIST_DIR: the graph rows skipped" | tee "$OUT/fmnist_graph_cuda.txt"
  fi
fi
# kernels per step against the CPU stand-in of benchmarks/count_step_ops.py (issue 27): calibrates
# the stand-in that CPU-only sessions report
if want ops && [ "$CUDA" = 1 ]; then
  timeout ${OPS_TIMEOUT:-150} "$PY" benchmarks/count_step_ops.py --fused-map --device cuda 2>&1 | grep -v "USDT\|^W" \
    | tee "$OUT/count_step_ops_cuda.txt" | tail -8
fi
# the whole suite on this machine's torch (CPU paths; pytest-xdist where installed)
if want suite; then
  XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8 -p no:benchmark")
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider $XDIST 2>&1 | tee "$OUT/tests_all.txt" | tail -5
fi
