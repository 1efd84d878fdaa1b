"""``fp8scope export RUN``: TensorBoard scalars and/or Parquet files from a run.

``--tensorboard DIR`` writes one scalar series per layer/tensor/stat (tag
``LAYER/TENSOR/STAT``, rank > 0 as ``rankN/...``), the run's scalars under ``train/NAME``
and the detected events as text. ``--parquet DIR`` writes every table of the run as
``DIR/TABLE.parquet`` plus the offline-detected events as ``DIR/detected_events.parquet``.
"""

from __future__ import annotations

import os

from fp8scope.derived import DERIVED
from fp8scope.errors import UsageError

STATS = ("amax", "scale_inv", "underflow_pct", "overflow_pct", "saturated_pct", "nonfinite", "sqnr_db")
_EXPR = {
    "amax": "amax", "scale_inv": "scale_inv", "scale": "scale", "expected_amax": "expected_amax",
    "min_nonzero": "min_nonzero", "qerr_mse": "qerr_mse", "range": "fp8_max * scale_inv",
    **{k: d.sql for k, d in DERIVED.items()},  # the one table of derived statistics
}


def register(sub) -> None:
    p = sub.add_parser("export", help="export a run to TensorBoard event files and/or Parquet")
    p.add_argument("run", help="run folder")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files here")
    p.add_argument("--parquet", metavar="DIR", help="write one Parquet file per table here")
    p.add_argument("--stats", default=",".join(STATS),
                   help=f"comma-separated stats for TensorBoard (available: {', '.join(_EXPR)})")
    p.add_argument("--every", type=int, default=1, help="TensorBoard: keep every Nth step")
    p.set_defaults(func=run)


def run(args) -> int:
    from fp8scope.run import load_run

    if not args.tensorboard and not args.parquet:
        raise UsageError("give --tensorboard DIR and/or --parquet DIR")
    if args.every < 1:
        raise UsageError("--every must be >= 1")
    stats = [s.strip() for s in args.stats.split(",") if s.strip()]
    bad = [s for s in stats if s not in _EXPR]
    if bad:
        raise UsageError(f"unknown stat(s) {bad}; available: {', '.join(_EXPR)}")
    r = load_run(args.run)
    if args.parquet:
        n = export_parquet(r, args.parquet)
        print(f"wrote {n} Parquet files to {args.parquet}")
    if args.tensorboard:
        n = export_tensorboard(r, args.tensorboard, stats, args.every)
        print(f"wrote {n} TensorBoard scalar points to {args.tensorboard}")
    return 0


def _mkdir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {exc}") from None


def export_parquet(r, out: str) -> int:
    import pyarrow.parquet as pq

    from fp8scope.cli.progress import items
    from fp8scope.detect import detect, events_batch

    _mkdir(out)
    names = r.table_names()
    n = 0
    with items("exporting parquet", len(names) + 1) as advance:
        for name in names:
            pq.write_table(r.table(name), os.path.join(out, f"{name}.parquet"))
            n += 1
            advance()
        import pyarrow as pa

        ev = detect(r)
        pq.write_table(pa.Table.from_batches([events_batch(ev)]), os.path.join(out, "detected_events.parquet"))
        advance()
    return n + 1


def export_tensorboard(r, out: str, stats: list[str], every: int = 1) -> int:
    from torch.utils.tensorboard import SummaryWriter

    from fp8scope.cli.progress import items
    from fp8scope.detect import detect

    _mkdir(out)
    n = 0
    names = r.table_names()
    w = SummaryWriter(log_dir=out)
    try:
        if "tensors" in names:
            sel = ", ".join(f"cast({_EXPR[s]} as double) as \"{s}\"" for s in stats)
            df = r.sql(f"select step, rank, layer, tensor, {sel} from tensors "
                       f"where step % {int(every)} = 0 order by layer, tensor, rank, step")
            groups = df.groupby(["rank", "layer", "tensor"], sort=False)
            with items("exporting tensorboard", groups.ngroups) as advance:
                for (rank, layer, tensor), g in groups:
                    prefix = f"{layer}/{tensor}" if int(rank) == 0 else f"rank{int(rank)}/{layer}/{tensor}"
                    steps = g["step"].to_numpy()
                    for s in stats:
                        vals = g[s].to_numpy(dtype=float)
                        for st, v in zip(steps, vals):
                            if v == v:  # skip NaN (stat not computed on cheap rows)
                                w.add_scalar(f"{prefix}/{s}", float(v), int(st))
                                n += 1
                    advance()
        if "scalars" in names:
            s = r.scalars()
            for row in s.itertuples(index=False):
                tag = f"train/{row.name}" if int(row.rank) == 0 else f"train/rank{int(row.rank)}/{row.name}"
                w.add_scalar(tag, float(row.value), int(row.step))
                n += 1
        ev = detect(r)
        for row in ev[ev["severity"] != "info"].head(1000).itertuples(index=False):
            w.add_text("events", f"[{row.severity}] {row.rule}: {row.message}", int(row.step))
    finally:
        w.close()
    return n
