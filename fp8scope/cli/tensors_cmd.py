"""``fp8scope tensors RUN``: the per-tensor stats as a table, filtered by layer, role and steps."""

from __future__ import annotations

import re

from fp8scope.cli.output import print_frame
from fp8scope.errors import UsageError
from fp8scope.run import load_run
from fp8scope.schema import ROLES, base_role

DEFAULT_COLUMNS = [
    "step", "rank", "layer", "tensor", "fp8_format", "amax", "expected_amax", "scale_inv",
    "overflow", "underflow", "saturated", "nonfinite", "sqnr_db",
]


def register(sub) -> None:
    p = sub.add_parser("tensors", help="per-tensor stats table (filter by layer, role, last N steps)")
    p.add_argument("run", help="run folder")
    p.add_argument("--layer", help="regex searched in layer names, e.g. 'blocks\\.2\\.mlp'")
    p.add_argument("--tensor", help=f"tensor: a role ({', '.join(ROLES)}) or a role's second cast (gradient@dim1)")
    p.add_argument("--last", type=int, help="only the last N logged steps")
    p.add_argument("--rank", type=int, help="only this rank")
    p.add_argument("--columns", help="comma-separated columns to show")
    p.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.layer is not None:
        try:
            re.compile(args.layer)
        except re.error as exc:
            raise UsageError(f"bad --layer regex {args.layer!r}: {exc}") from None
    if args.last is not None and args.last < 1:
        raise UsageError("--last must be >= 1")
    if args.tensor is not None and base_role(args.tensor) not in ROLES:
        raise UsageError(f"unknown --tensor {args.tensor!r}; expected one of {', '.join(ROLES)} (or role@axis)")
    # one query per process: read the streams zero-copy instead of copying the run into memory first
    # (6.4M rows: 0.24 s instead of 2.9 s, and ~1.5 GB less memory)
    r = load_run(args.run, combine_chunks=False)
    df = r.tensors(layer=args.layer, tensor=args.tensor, last=args.last, rank=args.rank)
    cols = [c.strip() for c in args.columns.split(",")] if args.columns else DEFAULT_COLUMNS
    unknown = [c for c in cols if c not in df.columns]
    if unknown:
        raise UsageError(f"unknown column(s) {unknown}; available: {', '.join(df.columns)}")
    if args.csv:
        df[cols].to_csv(__import__("sys").stdout, index=False)
        return 0
    if df.empty:
        print("no rows match")
        return 0
    print_frame(df, title=f"{args.run}: {len(df)} rows", columns=cols)
    return 0
