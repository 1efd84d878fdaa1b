#!/bin/bash
# The GPU checks, in one call of at most 10 minutes (a lent GPU is short): the GPU tests, the first
# steps with the stats compiled ahead and at first use, the 1.1B Llama's capture ratios; PART=2 and
# PART=3 (below) the rest. Run from the
# repository root; logs go to $OUT (default ./gpu-out). WHEELS=DIR installs extra wheels first
# (torchao, duckdb: what the machine lacks) into /tmp/site.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
# at most 590 s in all (a command's limit on a lent machine is 600 s); each step's output survives
# its timeout, and each test's result reaches $OUT as it ends (-v), even if pytest is cut. On an H100 with
# cold caches the GPU tests took over 250 s (the compiled-model tests about a minute each).
# PART=2 runs what does not fit beside them, in a second call on the warm machine (it has 30 s):
# the per-tensor costs and the demo model's eager ratios; PART=3 the compiled model's ratios.
case "${PART:-1}" in
2)
  timeout 60 python3 benchmarks/capture_cost.py --device cuda --sections tensor,calls --rounds 3 2>&1 \
    | grep -v "Warning\|^fp8scope step\|warn(" | tee "$OUT/capture.txt"
  timeout 70 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes eager --rounds 3 2>&1 \
    | grep -v "Warning\|^fp8scope step\|warn(" | tee "$OUT/ratio_eager.txt"
  exit 0;;
3)
  timeout 400 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes compiled --models off \
    --rounds 5 2>&1 | grep -v "Warning\|^fp8scope step\|warn(" | tee "$OUT/ratio_compiled.txt"
  exit 0;;
esac
timeout 320 python3 -m pytest -m gpu -v -p no:cacheprovider -p no:logging -rfEs --tb=short --durations=5 \
  tests/test_gpu.py 2>&1 | grep -v "^fp8scope step" > "$OUT/pytest.txt"
tail -40 "$OUT/pytest.txt"
timeout 110 python3 benchmarks/capture_cost.py --device cuda --sections first --first-steps 40 --first-modes sync,ahead --first-cap 45 \
  2>&1 | grep -v "Warning\|^fp8scope step\|warn(" | tee "$OUT/first.txt"
timeout 110 python3 benchmarks/large_model.py --device cuda --models off --rounds 3 2>&1 \
  | grep -v "Warning\|^fp8scope step\|warn(\|Configuration class" | tee "$OUT/large.txt"
