"""Compiling fp8scope's variants ahead, in a child process, while training goes on eagerly.

Why a child process: a compile traces (``make_fx``, AOTAutograd), and torch's tracing is
process-wide: it replaces ``torch.nn.Module.__call__`` for every thread and sets FX's global
tracing flag. A helper thread that compiled beside training ran the training thread's module calls
through its tracer and ended a ``torch.compile``d model ("Detected that you are using FX to
symbolically trace a dynamo-optimized function"), and its OpenMP team slowed every later eager op
on a machine with few cores. Compiling on the training thread is safe but stalls the step that
first needs a variant, for as long as the compile takes (seconds per variant; Triton's on a GPU).
A child process traces and compiles with nothing of the parent's to disturb, saves inductor's
artifact (``torch._inductor.standalone_compile``), and the parent loads it (milliseconds, on the
thread that next calls the variant) and runs eagerly until then.

One child at a time, one variant per child, from one daemon thread here: the thread only waits on
the child and pre-imports what the load needs; it never traces or runs a kernel. The child sees the
parent's ``sys.path`` and environment, the parent's torch thread count (inductor's C++ is generated
for it) and, on CUDA, the parent's device (its code launches there). The child is killed when the
parent exits; a child that fails or runs past :data:`TIMEOUT_S` leaves its variant eager.

The request and reply are JSON (keys hold strings, bools, ints, tuples and torch dtypes): the
package does not unpickle.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Hashable

TIMEOUT_S = 900.0
CHILD_MODULE = "fp8scope.compile_child"


def encode(value):
    """``value`` (a key, a spec) as JSON-able data; tuples, dtypes and devices tagged."""
    import torch

    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot send a {type(value).__name__} to the compile child")


def decode(value):
    """The inverse of :func:`encode`."""
    import torch

    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(decode(v) for v in value["tuple"])
        if "dtype" in value:
            dtype = getattr(torch, value["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"not a dtype: {value['dtype']}")
            return dtype
        if "device" in value:
            return torch.device(value["device"])
        raise ValueError(f"unknown tag in {sorted(value)}")
    return value


class Build:
    """One variant's compile in a child: ``result`` once ``done`` is set: ``("direct", artifact
    path, spec, single output?, seconds)``, ``("not_direct", reason, seconds)`` (it could not
    build the directly called code: a shape relation, dynamo's to check, in the parent) or
    ``("error", reason, seconds)`` (the child itself failed: no reply)."""

    def __init__(self, family: str, module: str, key: Hashable, device_index: int | None):
        self.family, self.module, self.key, self.device_index = family, module, key, device_index
        self.done = threading.Event()
        self.result: tuple | None = None
        self.path = ""


_queue: "queue.Queue[Build]" = queue.Queue()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_dir: str | None = None
_running: subprocess.Popen | None = None
_count = 0


def request(family: str, module: str, key: Hashable, device_index: int | None) -> Build:
    """Queue ``key`` of ``family`` (defined at the top level of ``module``) for a child to compile."""
    global _thread, _dir, _count
    build = Build(family, module, key, device_index)
    with _lock:
        if _dir is None:
            _dir = tempfile.mkdtemp(prefix="fp8scope-compile-")
            atexit.register(_cleanup)
        _count += 1
        build.path = os.path.join(_dir, f"{family}-{_count}")
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="fp8scope-compile-ahead", daemon=True)
            _thread.start()
    _queue.put(build)
    return build


def _serve() -> None:
    warmed: set[str] = set()
    while True:
        build = _queue.get()
        try:
            build.result = _run_child(build)
        except Exception as exc:  # never the training's problem: the variant compiles in the parent
            build.result = ("error", f"{type(exc).__name__}: {exc}", 0.0)
        if build.result[0] == "direct":
            try:
                _warm(build.key[0], warmed)
            except Exception:  # only a head start: the load does the same, on the training thread
                pass
        build.done.set()


def _warm(device_type: str, warmed: set[str]) -> None:
    """What a first load would otherwise do on the training thread: inductor's imports (Triton's
    on a GPU), torch's source hash (the artifact's key) and, for the CPU, the probe of the vector
    instruction set (compiler subprocesses). Imports and hashing only: nothing here traces or
    patches torch."""
    if device_type in warmed:
        return
    warmed.add(device_type)
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401  (the load imports it: a second and more)
    import torch._inductor.standalone_compile  # noqa: F401
    from torch._inductor.codecache import torch_key

    torch_key()
    if device_type == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    else:  # Triton and inductor's launcher, which the loaded code imports
        import torch._inductor.runtime.triton_heuristics  # noqa: F401


def _child_env() -> dict:
    import fp8scope

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fp8scope.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # a few kernels: no pool of compile workers beside training
    return env


def _run_child(build: Build) -> tuple:
    """Run one child for ``build`` and read its reply."""
    import torch

    global _running
    start = time.perf_counter()
    request = {"family": build.family, "module": build.module, "key": encode(build.key),
               "device_index": build.device_index, "threads": torch.get_num_threads(),
               "path": build.path, "sys_path": [p for p in sys.path if isinstance(p, str)]}
    with _lock:
        proc = _running = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_child_env())
    try:
        _, err = proc.communicate(json.dumps(request).encode(), timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return ("error", f"the compile child ran past {TIMEOUT_S:.0f} s", time.perf_counter() - start)
    finally:
        with _lock:
            _running = None
    seconds = time.perf_counter() - start
    try:
        with open(build.path + ".json") as f:
            reply = json.load(f)
    except (OSError, ValueError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return ("error", f"the compile child failed: {tail[0][:300]}", seconds)
    if reply["kind"] == "direct":
        return ("direct", build.path, decode(reply["spec"]), reply["single"], seconds)
    return ("not_direct", reply["reason"], seconds)


def _cleanup() -> None:
    with _lock:
        proc = _running
    if proc is not None and proc.poll() is None:
        proc.kill()
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
