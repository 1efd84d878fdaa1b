"""``fp8scope dashboard [RUNS_ROOT]``: serve the Dash dashboard over the runs under a folder."""

from __future__ import annotations

import os
import sys

from fp8scope.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("dashboard", help="web dashboard over the runs under a folder (live, heatmaps, outliers)")
    p.add_argument("root", nargs="?", default="runs", help="folder holding run folders (default: runs)")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; the app has no authentication)")
    p.add_argument("--refresh-ms", type=int, default=1500, help="live refresh interval (default 1500)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not os.path.isdir(args.root):
        raise UsageError(f"{args.root}: no such folder")
    try:
        from dashboard.app import create_app
    except ImportError as e:
        raise UsageError(f"the dashboard needs dash and plotly: pip install 'fp8scope[dashboard]' ({e})") from None
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = create_app(args.root, interval_ms=max(250, args.refresh_ms))
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        sys.stderr.write(f"warning: serving on {args.host}: anyone who can reach it can read the runs under {args.root}\n")
    sys.stderr.write(f"fp8scope dashboard: http://{args.host}:{args.port}/  (runs under {os.path.abspath(args.root)})\n")
    app.run(host=args.host, port=args.port, debug=False)
    return 0
