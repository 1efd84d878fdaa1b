"""``fp8scope`` command line: one sub-command per module in this package.

Every sub-command module exposes ``register(subparsers)`` and a ``run(args) -> int``.
Errors the user can fix (bad flags, bad run folders) print one line and exit 2; nothing
prints a traceback unless ``FP8SCOPE_DEBUG=1`` is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from fp8scope import __version__
from fp8scope.errors import Fp8ScopeError
from fp8scope.priority import NICE_FLAG_DEFAULT, wanted_niceness, yield_to_training

# Sub-command modules, in the order `fp8scope --help` lists them. Later issues append theirs.
# Commands that train or only inspect the machine keep their priority; every other command reads
# runs, possibly beside a training job, and yields the CPU to it when asked (--nice,
# FP8SCOPE_NICE: fp8scope/priority.py).
KEEP_PRIORITY = {"demo", "doctor"}
COMMANDS = ["info", "tensors", "compact", "doctor", "demo"]
OPTIONAL_COMMANDS = ["events", "report", "diff", "whatif", "export", "dashboard"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fp8scope", description="Why is my FP8 run unstable, where, and is FP8 to blame?")
    parser.add_argument("--version", action="version", version=f"fp8scope {__version__}")
    parser.add_argument("--nice", metavar="N", nargs="?", const=NICE_FLAG_DEFAULT, type=int,
                        help="reading commands run at niceness N (default 19: on spare CPU, beside a training job); "
                             "also FP8SCOPE_NICE=N. Off by default")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS + OPTIONAL_COMMANDS:
        try:
            mod = import_module(f"fp8scope.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if name in OPTIONAL_COMMANDS and exc.name == f"fp8scope.cli.{name}_cmd":
                continue
            raise
        mod.register(sub)
    return parser


def _command_word(argv: list[str]) -> str | None:
    """The sub-command as typed (first word that is not an option), before any parsing."""
    return next((a for a in argv if not a.startswith("-")), None)


def _nice_flag(argv: list[str]) -> tuple[list[str], int | None]:
    """``argv`` without ``--nice`` / ``--nice=N`` (accepted anywhere on the line), and its value."""
    rest, value = [], None
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a == "--nice":
            value = NICE_FLAG_DEFAULT
            if i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit():  # --nice N
                value = int(argv[i + 1])
                next(it, None)
        elif a.startswith("--nice="):
            try:
                value = int(a.split("=", 1)[1])
            except ValueError:
                sys.stderr.write(f"fp8scope: error: --nice expects an integer, got {a!r}\n")
                raise SystemExit(2) from None
        else:
            rest.append(a)
    return rest, value


def main(argv: list[str] | None = None) -> int:
    argv, nice = _nice_flag(sys.argv[1:] if argv is None else list(argv))
    # Asked to yield (--nice, FP8SCOPE_NICE): before anything else, since building the parser
    # imports pandas (~0.5 s of CPU) and that too should run on spare CPU beside a training job.
    wanted = wanted_niceness(nice)
    if wanted > 0 and _command_word(argv) not in KEEP_PRIORITY:
        yield_to_training(wanted)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except Fp8ScopeError as exc:
        sys.stderr.write(f"fp8scope {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("fp8scope: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if os.environ.get("FP8SCOPE_DEBUG"):
            raise
        sys.stderr.write(
            f"fp8scope {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set FP8SCOPE_DEBUG=1 for a traceback)\n"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
