#!/usr/bin/env bash
# Set up a fresh machine for fp8scope: a venv in .venv with the pinned CPU torch and every
# extra the tests use, plus Debian's chromium for the dashboard's browser tests.
# Idempotent: re-running it on a set-up machine takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/bin/chromium ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing Debian's chromium (browser tests)"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# constraints pin torch to the local CPU build; pyproject keeps torch loose for users.
.venv/bin/python -m pip install -q -c .ci/constraints.txt -e '.[dev]'
# triton, apart from the venv (.triton/, on no test's path but one's): benchmarks/triton_kernels.py
# generates inductor's CUDA kernels with it on a machine without a GPU, and a test counts them.
TRITON=$(grep -E '^triton==' .ci/constraints.txt | cut -d= -f3)
if [ ! -f ".triton/triton-$TRITON.stamp" ]; then
  rm -rf .triton
  .venv/bin/python -m pip install -q --no-deps --target .triton "triton==$TRITON"
  touch ".triton/triton-$TRITON.stamp"
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
