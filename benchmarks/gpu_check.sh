#!/bin/bash
# The GPU checks, in calls that fit one 15-minute lease: PART=1 and 2, then 3 where time is left. A
# machine's start takes half a minute to two of the lease, and a warm machine waits 30 s for the
# next call: start the next part at once. The parts go in the order of what they decide, and each
# step's output reaches $OUT as it goes, so a call cut short by the lease still returns what ran.
# Run from the repository root; logs go to $OUT (default ./gpu-out). WHEELS=DIR installs extra
# wheels first (torchao, duckdb, plotly: what the machine lacks) into /tmp/site.
#   PART=1  (about 8.5 minutes) the whole `pytest -m gpu` (the host-sync tests among them; on 8
#           workers where pytest-xdist is installed: 94 s on an H100), the first steps with the stats
#           compiled ahead and at first use (does a compile stall a step?), the compiled emulated
#           demo model's ratios (three compiles of one whole graph each: more than 250 s on an H100)
#   PART=2  (about 5 minutes) the 1.1B Llama's ratios (large_model.py), where its cheap step goes
#           (step_profile.py: kernels, host syncs, CPU per thread, the training thread's Python)
#   PART=3  (about 4 minutes) the eager demo model's ratios, the compiled what-if ones, the host-bound
#           section (online detection's rules in their child process and in a thread)
#   STEPS=moe  a Mixtral's experts under each transformers experts implementation, eager and compiled
#           (capture_cost.py --sections moe; needs transformers and its dependencies on the machine or
#           among WHEELS)
#   STEPS=restart  the compiled demo model's first steps in a fresh process, again over the cache the
#           first process left (capture_cost.py --sections restart: a monitored model's graphs from
#           inductor's cache, as an unmonitored one's)
#   STEPS="large hostbound ..." runs the named steps (the functions below) instead, in that order:
#           a lease that cannot hold every part runs what decides most first
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
quiet() { grep -v "Warning\|^fp8scope step\|warn(\|Configuration class\|USDT\|profiler_st"; }
# each step's output survives its timeout; each test's result reaches $OUT as it ends (-v)
pytest_gpu() {
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout 170 python3 -m pytest -m gpu $workers -v -p no:cacheprovider -p no:logging -rfEs --tb=short \
    --durations=5 tests/test_gpu.py 2>&1 | quiet > "$OUT/pytest.txt"
  tail -30 "$OUT/pytest.txt"; }
compiled_emulated() {
  timeout 300 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes compiled --models delayed \
    --rounds 3 2>&1 | quiet | tee "$OUT/ratio_compiled_emulated.txt"; }
compiled_whatif() {
  timeout 100 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes compiled --models off \
    --rounds 3 2>&1 | quiet | tee "$OUT/ratio_compiled_whatif.txt"; }
large() {
  timeout 110 python3 benchmarks/large_model.py --device cuda --models off --rounds 3 2>&1 | quiet | tee "$OUT/large.txt"; }
profile() {
  timeout 180 python3 benchmarks/step_profile.py --device cuda 2>&1 | quiet | tee "$OUT/step_profile.txt"; }
eager() {
  timeout 60 python3 benchmarks/capture_cost.py --device cuda --sections ratio --modes eager --rounds 3 2>&1 | quiet \
    | tee "$OUT/ratio_eager.txt"; }
hostbound() {
  timeout 90 python3 benchmarks/capture_cost.py --device cuda --sections hostbound --rounds 8 2>&1 | quiet \
    | tee "$OUT/hostbound.txt"; }
moe() {
  timeout 300 python3 benchmarks/capture_cost.py --device cuda --sections moe --moe-modes eager,compiled --rounds 4 \
    2>&1 | quiet \
    | tee "$OUT/moe.txt"; }
restart() {
  timeout 300 python3 benchmarks/capture_cost.py --device cuda --sections restart 2>&1 | quiet | tee "$OUT/restart.txt"; }
first() {
  timeout 120 python3 benchmarks/capture_cost.py --device cuda --sections first --first-steps 40 \
    --first-modes sync,ahead --first-cap 30 2>&1 | quiet | tee "$OUT/first.txt"; }
case "${PART:-1}" in
1) STEPS=${STEPS:-"pytest_gpu first compiled_emulated"};;
2) STEPS=${STEPS:-"large profile"};;
3) STEPS=${STEPS:-"eager compiled_whatif hostbound"};;
esac
for step in $STEPS; do "$step"; done
