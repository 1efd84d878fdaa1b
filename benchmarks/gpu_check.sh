#!/bin/bash
# The GPU checks, in calls of at most 10 minutes each (a lent GPU is short: 15 minutes in all, so
# the parts go in the order of what they decide). Run from the repository root; logs go to $OUT
# (default ./gpu-out). WHEELS=DIR installs extra wheels first (torchao, duckdb: what the machine
# lacks) into /tmp/site. A warm machine waits 30 s for the next call: start the next part at once.
#   PART=1  the host-sync tests, where the 1.1B Llama's cheap step goes (step_profile.py), its
#           ratios, the first steps with the stats compiled ahead and at first use (about 5 minutes)
#   PART=2  the whole `pytest -m gpu` (cold caches: over 250 s)
#   PART=3  the per-tensor costs, the demo model's eager ratios and where its what-if monitor's time goes
#   PART=4  the compiled demo model's ratios
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
quiet() { grep -v "Warning\|^fp8scope step\|warn(\|Configuration class\|USDT\|profiler_st"; }
# each step's output survives its timeout; each test's result reaches $OUT as it ends (-v)
case "${PART:-1}" in
1)
  timeout 200 python3 -m pytest -v -p no:cacheprovider -p no:logging -rfEs --tb=short -k host_sync \
    tests/test_gpu.py tests/test_host_sync.py 2>&1 | quiet > "$OUT/pytest_sync.txt"
  tail -15 "$OUT/pytest_sync.txt"
  timeout 150 python3 benchmarks/step_profile.py --device cuda 2>&1 | quiet | tee "$OUT/step_profile.txt"
  timeout 110 python3 benchmarks/large_model.py --device cuda --models off --rounds 3 2>&1 | quiet | tee "$OUT/large.txt"
  timeout 110 python3 benchmarks/capture_cost.py --device cuda --sections first --first-steps 40 \
    --first-modes sync,ahead --first-cap 45 2>&1 | quiet | tee "$OUT/first.txt";;
2)
  timeout 580 python3 -m pytest -m gpu -v -p no:cacheprovider -p no:logging -rfEs --tb=short --durations=5 \
    tests/test_gpu.py 2>&1 | quiet > "$OUT/pytest.txt"
  tail -40 "$OUT/pytest.txt";;
3)
  timeout 60 python3 benchmarks/capture_cost.py --device cuda --sections tensor,calls --rounds 3 2>&1 | quiet \
    | tee "$OUT/capture.txt"
  timeout 70 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes eager --rounds 3 2>&1 | quiet \
    | tee "$OUT/ratio_eager.txt"
  timeout 70 python3 benchmarks/capture_cost.py --device cuda --sections parts --rounds 3 2>&1 | quiet \
    | tee "$OUT/ratio_parts.txt";;
4)
  timeout 400 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes compiled --models off \
    --rounds 5 2>&1 | quiet | tee "$OUT/ratio_compiled.txt";;
esac
