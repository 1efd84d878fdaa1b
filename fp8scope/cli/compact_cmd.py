"""``fp8scope compact RUN``: write the run's tables to Parquet (zstd) for archiving and fast reads."""

from __future__ import annotations

from fp8scope.cli.output import human_size
from fp8scope.errors import RunError
from fp8scope.run import load_run
from fp8scope.store.compact import compact


def register(sub) -> None:
    p = sub.add_parser("compact", help="write Parquet (zstd) copies of the run's tables; readers then use them")
    p.add_argument("run", help="run folder")
    p.add_argument("--delete-streams", action="store_true", help="remove the Arrow streams once compacted")
    p.set_defaults(func=run)


def run(args) -> int:
    load_run(args.run)  # validates the folder first: a one-line error, nothing written
    try:
        result = compact(args.run, delete_streams=args.delete_streams)
    except OSError as exc:  # read-only or full disk: the user's problem to fix, in one line
        raise RunError(f"cannot write the compacted tables into {args.run} ({exc.strerror or exc})") from None
    tables = result.get("tables", result)
    print(f"compacted {args.run}: {tables}")
    return 0
