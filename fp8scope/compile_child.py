"""The child process that compiles one variant for a training process (``fp8scope.compile_ahead``).

It reads a JSON request on stdin, imports the module that defines the variant's family (the
parent's ``sys.path`` first, so that what the parent imported is found), takes the parent's torch
thread count and CUDA device, traces and compiles the variant as the parent would
(``fp8scope.compiled.build``), saves inductor's artifact to the requested path and writes its
reply, JSON, beside it. Its exit status is 0 when a reply was written."""

from __future__ import annotations

import importlib
import json
import os
import sys


def _reply(path: str, **reply) -> None:
    tmp = path + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(reply, f)
    os.replace(tmp, path + ".json")  # whole, or not at all


def main() -> int:
    request = json.loads(sys.stdin.buffer.read())
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
        return 0
    artifact.save(path=path, format="binary")
    _reply(path, kind="direct", spec=compile_ahead.encode(spec), single=single)
    return 0


if __name__ == "__main__":
    sys.exit(main())
