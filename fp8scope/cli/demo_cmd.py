"""``fp8scope demo``: a monitored FP8 training run with a planted instability, then its post-mortem.

Runs the tiny GPT (``fp8scope.demo.train``) on CPU under emulated FP8 delayed scaling with
an activation outlier planted in one MLP down-projection, then shows what fp8scope saw and
where the data is. Takes well under two minutes on a laptop CPU.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DEFAULT_INJECT = ["outlier:blocks.2.mlp.down:150"]


def register(sub) -> None:
    p = sub.add_parser("demo", help="train a tiny GPT in emulated FP8 with a planted instability, then report")
    p.add_argument("--run-dir", default="runs/demo", help="where to write the run (replaced if it exists)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--inject", action="append", default=None,
                   help=f"planted failure spec, repeatable (default {DEFAULT_INJECT[0]}); 'none' for a clean run. "
                        "Kinds: outlier:LAYER:STEP[:FACTOR[:DURATION]], nan:LAYER:STEP, gradscale:LAYER:STEP[:FACTOR], "
                        "lr:STEP[:FACTOR], grow:LAYER:STEP[:FACTOR[:DURATION]], reset:LAYER:STEP, batch:STEP[:DURATION] "
                        "(fp8scope/demo/inject.py)")
    p.add_argument("--every", type=int, default=10, help="full stats every N steps")
    p.set_defaults(func=run)


def run(args) -> int:
    from fp8scope.demo import train
    from fp8scope.errors import UsageError

    if args.steps < 1:
        raise UsageError("--steps must be >= 1")
    injects = DEFAULT_INJECT if args.inject is None else [i for i in args.inject if i != "none"]
    run_dir = Path(args.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = ["--run-dir", str(run_dir), "--steps", str(args.steps), "--every", str(args.every)]
    for spec in injects:
        argv += ["--inject", spec]
    print(f"fp8scope demo: training a tiny GPT in emulated FP8 (delayed scaling) for {args.steps} steps"
          + (f", planted: {', '.join(injects)}" if injects else ", no planted failure"), flush=True)
    rc = train.main(argv)
    if rc not in (0, None):
        return int(rc)
    from fp8scope.cli import info_cmd

    print()
    info_cmd.run(_Args(run=str(run_dir), json=False))
    _post_mortem(run_dir)
    print(f"\nData: {run_dir.resolve()}  (Python: fp8scope.load_run({str(run_dir)!r}).tensors())")
    print(f"Dashboard: fp8scope dashboard {run_dir.parent}   then open http://127.0.0.1:8050")
    sys.stdout.flush()
    return 0


class _Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _post_mortem(run_dir: Path) -> None:
    """The report when the detection package is installed; else the tensors that overflowed."""
    try:
        from fp8scope.cli import report_cmd
    except ImportError:
        report_cmd = None
    if report_cmd is not None:
        print()
        report_cmd.run(_Args(run=str(run_dir), html=None, json=False))
        return
    from fp8scope.cli.output import print_frame
    from fp8scope.run import load_run

    df = load_run(run_dir).tensors()
    bad = df[(df["overflow"].fillna(0) > 0) | (df["nonfinite"].fillna(0) > 0) | (df["amax"] > df["expected_amax"] * 8)]
    if bad.empty:
        print("\nno overflow or non-finite values logged")
        return
    print_frame(bad.head(15), title="first tensors that overflowed or went non-finite",
                columns=["step", "layer", "tensor", "amax", "expected_amax", "overflow", "underflow", "nonfinite"])
