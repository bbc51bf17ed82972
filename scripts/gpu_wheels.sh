#!/usr/bin/env bash
# Download (here, where pip reaches PyPI) the pure-Python wheels pyro_bnn needs that the
# device machine's image lacks (it has torch, numpy, scipy, pandas, xarray, scikit-learn,
# matplotlib, pytest), into .whl/ (git-ignored). Then on the device, with `carry: [".whl"]`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && OUT=$OUT PY=python3 scripts/gpu_check.sh ./mnist
# (copy ../shared/data/mnist into a carried, git-ignored folder first: ../shared does not travel).
set -euo pipefail
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pyro-ppl==1.9.2 pyro-api==0.1.2 arviz==1.3.0 arviz-base==1.3.1 arviz-stats==1.3.3 \
  arviz-plots==1.3.2 xarray-einstats==0.11.0 h5netcdf==1.8.2
du -sh .whl
