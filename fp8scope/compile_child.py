"""The child process that compiles variants for a training process (``fp8scope.compile_ahead``).

It reads JSON requests on stdin, one a line. For each it imports the module that defines the
variant's family (the parent's ``sys.path`` first, so that what the parent imported is found), takes
the parent's torch thread count and CUDA device, traces and compiles the variant as the parent would
(``fp8scope.compiled.build``), saves inductor's artifact to the requested path, writes its reply,
JSON, beside it and says ``done``. One child serves a run's variants one after another: a child
per variant paid a Python start, torch's import and a CUDA context each time (on an H100, most of
the time the demo model's three variants took)."""

from __future__ import annotations

import importlib
import json
import os
import select
import sys

IDLE_S = float(os.environ.get("FP8SCOPE_COMPILE_IDLE_S", "30"))
"""A child with no request for this long (seconds) exits, and its CUDA context with it (most
variants are asked for in a run's first steps; a later one starts a new child)."""


def _reply(path: str, **reply) -> None:
    tmp = path + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(reply, f)
    os.replace(tmp, path + ".json")  # whole, or not at all


def _build(request: dict) -> None:
    """One request: the variant built, its artifact saved and the reply written."""
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    import torch

    from fp8scope import compile_ahead, compiled

    torch.set_num_threads(request["threads"])
    if request["device_index"] is not None:
        torch.cuda.set_device(request["device_index"])
    importlib.import_module(request["module"])
    family = compiled.family(request["family"])
    key = compile_ahead.decode(request["key"])
    path = request["path"]
    try:
        artifact, spec, single = compiled.build(family, key)
    except Exception as exc:  # what the parent does then is compiled._compile_here's to decide, as in-process
        _reply(path, kind="not_direct", reason=f"{type(exc).__name__}: {exc}")
        return
    artifact.save(path=path, format="binary")
    _reply(path, kind="direct", spec=compile_ahead.encode(spec), single=single)


def main() -> int:
    """Serve requests, one JSON line each, answering ``done`` on a line of its own, until stdin
    closes or no request comes for :data:`IDLE_S` (exit status 0 both ways). Anything else that
    would go to stdout goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], IDLE_S)
        if not ready:
            return 0
        line = sys.stdin.readline()
        if not line:
            return 0
        _build(json.loads(line))
        out.write("done\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
