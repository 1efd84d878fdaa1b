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

One child, serving one variant after another (``compile_child``: it leaves when idle, and a later
request starts another), driven by one daemon thread here: the thread only starts the child, hands
it a request and waits for its answer; it never traces, imports or runs a kernel
(``compiled.prepare`` says why). The child sees the parent's ``sys.path`` and environment, the
parent's torch thread count (inductor's C++ is generated for it) and, on CUDA, the parent's device
(its code launches there). The child is killed when the parent exits; a child that fails or runs
past :data:`TIMEOUT_S` on a variant leaves that variant to the parent (``compiled._load``).

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

from fp8scope.child_env import child_env

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
    path, spec, single output?, seconds)``, ``("not_direct", reason)`` (it could not build the
    directly called code: a shape relation, dynamo's to check, in the parent) or ``("error",
    reason)`` (the child itself failed: no reply)."""

    def __init__(self, family: str, module: str, key: Hashable, device_index: int | None):
        self.family, self.module, self.key, self.device_index = family, module, key, device_index
        self.done = threading.Event()
        self.result: tuple | None = None
        self.path = ""


_queue: "queue.Queue[Build]" = queue.Queue()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_dir: str | None = None
_running: subprocess.Popen | None = None  # the child serving requests, if one is
_count = 0  # requests made
_children = 0  # children started


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
    """The daemon thread: hands the child one request after another and waits on each, the GIL
    released. It runs no other Python work (see ``compiled.prepare``: Python work on a thread beside training
    slows every training op)."""
    while True:
        build = _queue.get()
        try:
            build.result = _run_child(build)
        except Exception as exc:  # never the training's problem: the variant compiles in the parent
            build.result = ("error", f"{type(exc).__name__}: {exc}")
        build.done.set()


def _start_child() -> subprocess.Popen:
    """A child that serves requests until none comes for ``compile_child.IDLE_S`` (its CUDA context
    then goes); its stderr goes to a file (a pipe nobody reads would fill and block it)."""
    global _children
    with _lock:
        _children += 1
        path = os.path.join(_dir, f"child-{_children}.err")
    with open(path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err,
                                # a few kernels: no pool of compile workers beside training
                                env=child_env(TORCHINDUCTOR_COMPILE_THREADS="1"))
    proc.err_path = path
    return proc


def _err_tail(proc: subprocess.Popen) -> str:
    try:
        with open(proc.err_path, "rb") as f:
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return (lines[-1:] or [f"exit status {proc.returncode}"])[0][:300]


def _ask(proc: subprocess.Popen, request: dict) -> str:
    """Send ``request``; ``"done"``, ``"gone"`` (the child had exited, idle, before reading it),
    ``"timeout"`` or ``"failed"``."""
    import select

    try:
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
    except OSError:  # it exited: idle (status 0) or dead
        proc.wait()
        return "gone" if proc.returncode == 0 else "failed"
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
    if not ready:
        return "timeout"
    if proc.stdout.readline().strip() == b"done":
        return "done"
    proc.wait()
    return "gone" if proc.returncode == 0 else "failed"  # 0: it left, idle, with the request unread


def _run_child(build: Build) -> tuple:
    """Have the child (started if none is running) build ``build`` and read its reply."""
    import torch

    global _running
    start = time.perf_counter()
    request = {"family": build.family, "module": build.module, "key": encode(build.key),
               "device_index": build.device_index, "threads": torch.get_num_threads(),
               "path": build.path, "sys_path": [p for p in sys.path if isinstance(p, str)]}
    for _ in range(2):  # a second child only if the first had just left, idle
        with _lock:
            proc = _running
        if proc is None or proc.poll() is not None:
            if proc is not None:
                _close(proc)
            proc = _start_child()
            with _lock:
                _running = proc
        answer = _ask(proc, request)
        if answer != "gone":
            break
    if answer == "timeout":
        _close(proc)
        return ("error", f"the compile child ran past {TIMEOUT_S:.0f} s")
    try:
        with open(build.path + ".json") as f:
            reply = json.load(f)
    except (OSError, ValueError):
        return ("error", f"the compile child failed: {_err_tail(proc)}")
    if reply["kind"] == "direct":
        return ("direct", build.path, decode(reply["spec"]), reply["single"], time.perf_counter() - start)
    return ("not_direct", reply["reason"])


def _close(proc: subprocess.Popen) -> None:
    """A child ended: kill it if it is not, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:  # a write end whose reader left: nothing is lost
            pass


def stop_child() -> None:
    """End the serving child, if one runs (the next request starts another)."""
    with _lock:
        proc = _running
    if proc is not None:
        _close(proc)


def _cleanup() -> None:
    stop_child()
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
