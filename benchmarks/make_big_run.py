"""Generate a big run for the detection / report benchmark: 10,000 steps x 500 tensors (5M rows).

    .venv/bin/python benchmarks/make_big_run.py [--steps 10000] [--tensors 500] [--out /tmp/fp8scope-big]

Goes through the real write path: per step a stats matrix laid out as schema.STAT_FIELDS,
``step_records.tensor_batch`` / ``scalar_batch`` (the writer thread's code) and
``store.writer.RunWriter`` (append-only Arrow IPC streams), plus a manifest. Statistics follow
delayed scaling (history 16) over slowly drifting log-normal amaxes; full stats every 10 steps.

Planted (so the report has something to find):
  * step 3000: amax spike 1000x in blocks.20.mlp.down activation (saturation, then stale scale);
  * step 6000: gradient underflow 60% in blocks.3.mlp.up gradient for 30 steps;
  * step 8000: NaN in blocks.30.attn.proj activation, propagating to later tensors for 5 steps;
  * step 9000: loss spike 3x.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8scope.step_payload import TensorKey  # noqa: E402
from fp8scope.schema import FIELD_INDEX, N_FIELDS  # noqa: E402
from fp8scope.step_records import scalar_batch, tensor_batch  # noqa: E402
from fp8scope.store.manifest import new_manifest, write_manifest  # noqa: E402
from fp8scope.store.writer import RunWriter  # noqa: E402

SUB = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
ROLES = ("activation", "weight", "gradient")
HIST = 16


def keys_for(n_tensors: int, source: str = "emulated") -> list[TensorKey]:
    keys = []
    i = 0
    while len(keys) < n_tensors:
        layer = f"blocks.{i // len(SUB)}.{SUB[i % len(SUB)]}"
        for role in ROLES:
            if len(keys) < n_tensors:
                fmt = "e5m2" if role == "gradient" else "e4m3"
                keys.append(TensorKey(layer, role, source, fmt, 57344.0 if fmt == "e5m2" else 448.0, (1024, 1024),
                                      "delayed"))
        i += 1
    return keys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--tensors", type=int, default=500)
    p.add_argument("--every", type=int, default=10, help="full stats every N steps")
    p.add_argument("--out", default="/tmp/fp8scope-big")
    p.add_argument("--source", default="emulated", choices=("emulated", "whatif"),
                   help="the rows' source: whatif for a run whose tensors a resumed monitor rebuilds (resume_cost.py)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    keys = keys_for(args.tensors, args.source)
    n = len(keys)
    rng = np.random.default_rng(0)
    write_manifest(out, new_manifest(recipe={"kind": "delayed", "margin": 0, "amax_history_len": HIST,
                                             "amax_compute_algo": "max", "fp8_format": "HYBRID"},
                                     world_size=1, meta={"benchmark": "make_big_run"}))
    w = RunWriter(out, 0)
    fp8_max = np.array([k.fp8_max for k in keys])
    is_grad = np.array([k.role == "gradient" for k in keys])
    base = np.where(is_grad, 1e-3, 1.0) * np.exp(rng.normal(0, 0.5, n))
    order = np.arange(n)
    name_idx = {(k.layer, k.role): i for i, k in enumerate(keys)}
    spike = name_idx.get(("blocks.20.mlp.down", "activation"), n // 2)
    uf = name_idx.get(("blocks.3.mlp.up", "gradient"), 11)
    nan_i = name_idx.get(("blocks.30.attn.proj", "activation"), (3 * n) // 4)
    hist = np.zeros((HIST, n))
    numel = float(1 << 20)
    t0 = time.perf_counter()
    for step in range(args.steps):
        drift = np.exp(0.3 * np.sin(step / 700.0 + order))
        amax = base * drift * np.exp(rng.normal(0, 0.05, n))
        if step == 3000:
            amax[spike] *= 1000.0
        if 8000 <= step < 8005:
            amax[nan_i:] = np.nan
        hmax = np.nanmax(np.where(hist > 0, hist, np.nan), axis=0) if step else np.full(n, np.nan)
        expected = np.where(np.isfinite(hmax), hmax, fp8_max)
        scale = fp8_max / expected
        full = step % args.every == 0
        m = np.full((n, N_FIELDS), np.nan)
        m[:, FIELD_INDEX["amax"]] = amax
        m[:, FIELD_INDEX["scale"]] = scale
        m[:, FIELD_INDEX["scale_inv"]] = 1.0 / scale
        m[:, FIELD_INDEX["expected_amax"]] = expected
        m[:, FIELD_INDEX["numel"]] = numel
        if full:
            over = np.where(amax > expected, numel * 0.02, 0.0)
            under = numel * 1e-4 * np.where(expected > 4 * amax, 100, 1)
            if 6000 <= step < 6030:
                under[uf] = numel * 0.6
            m[:, FIELD_INDEX["min_nonzero"]] = amax * 2.0 ** -16
            m[:, FIELD_INDEX["zeros"]] = 0
            m[:, FIELD_INDEX["nonfinite"]] = np.where(np.isnan(amax), 3.0, 0.0)
            m[:, FIELD_INDEX["overflow"]] = np.nan_to_num(over)
            m[:, FIELD_INDEX["underflow"]] = under
            m[:, FIELD_INDEX["saturated"]] = np.nan_to_num(over) + 1
            m[:, FIELD_INDEX["sq_err"]] = numel * 1e-6
            m[:, FIELD_INDEX["sq_signal"]] = numel * 1e-2
        w.write("tensors", tensor_batch(step, 0, m, list(range(n)), keys, full))
        loss = 3.0 * np.exp(-step / 4000) + rng.normal(0, 0.01)
        if step == 9000:
            loss *= 3
        gn = 1.0 + abs(rng.normal(0, 0.1))
        w.write("scalars", scalar_batch(step, 0, ["loss", "grad_norm", "lr"], [loss, gn, 1e-4], time.time()))
        hist = np.roll(hist, 1, axis=0)
        hist[0] = amax
        if step % 1000 == 0:
            print(f"step {step} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    w.close()
    print(f"wrote {args.steps} steps x {n} tensors = {args.steps * n:,} rows to {out} "
          f"in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
