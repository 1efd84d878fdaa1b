"""Online detection's rules in a child process, so that their Python never holds the training
process's GIL.

Why: the rules' pass over a step is Python and numpy on small arrays, and more of it the more
tensors a model has. In a thread of the training process it holds the GIL that the training thread
needs after every op it launches: where the host bounds a step (a small or compiled model on a GPU,
whose step is the host launching kernels) online detection cost the training more than the
monitor's captures did (``benchmarks/capture_cost.py --sections hostbound`` makes the demo model
that small on a CPU; docs/detection.md has the numbers).

:class:`ChildDetector` is an :class:`~fp8scope.detect.online.OnlineDetector` whose
:meth:`~ChildDetector.examine` runs in the child: the steps go there, the events come back, and the
parent reports them (the run's events table, logging, ``on_event``) as before. The child holds
the rules' state (each tensor's windows and edge flags), so online and offline detection stay one
code path (:class:`~fp8scope.detect.engine.TensorPass`). The parent waits for a pass's reply in
the detection thread with the GIL released.

The child is ``python -m fp8scope.detect.child``, started with the parent's interpreter and
fp8scope (``fp8scope.child_env``); it imports numpy, pyarrow and pandas, not torch. Messages on its
stdin and stdout are a length-prefixed JSON header and the binary blobs it counts: the config (answered
"ready"), then a pass's steps with their record batches as Arrow IPC blobs, answered by the pass's
events or the error it raised. No pickle: nothing the child reads can run code. It leaves when the
monitor closes (a "stop" message), when its stdin closes, or when its parent is gone (the training
process killed, also by SIGKILL, while a data loader's forked worker still holds the pipe).

If the child cannot start, dies, or does not answer, detection goes on in the parent's thread,
with one warning: windows start afresh there, so events that need history come later.
``FP8SCOPE_DETECT_PROCESS=0`` keeps detection in the thread from the start.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from fp8scope.child_env import child_env
from fp8scope.detect.config import DetectConfig
from fp8scope.detect.online import OnlineDetector, Step

MODULE = "fp8scope.detect.child"
START_TIMEOUT_S = 120.0
"""A child that has not started (imported numpy, pyarrow and pandas) in this long is ended."""
REPLY_TIMEOUT_S = 600.0
"""A pass whose reply takes longer than this (seconds) ends the child: detection goes on in the
parent. A backlog of 64 steps of a large model takes seconds, not minutes."""

_HEADER = struct.Struct("<Q")


def wanted() -> bool:
    """Whether online detection runs in a child process (``FP8SCOPE_DETECT_PROCESS``, default on).
    Not where the pipes cannot be waited on with ``select`` (Windows), nor from a frozen
    application, whose executable is not a Python that takes ``-m``."""
    if sys.platform == "win32" or getattr(sys, "frozen", False) or not sys.executable:
        return False
    return os.environ.get("FP8SCOPE_DETECT_PROCESS", "1").strip().lower() not in ("0", "false", "no", "off")


def _plain(value: Any) -> Any:
    """JSON for what the rules put in an event besides Python numbers and strings: numpy scalars."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _send(f, obj: Any, blobs: Sequence[bytes] = ()) -> None:
    """``obj`` (JSON, NaN allowed) and ``blobs`` as one message on ``f``, an unbuffered pipe (a raw
    write may take part of it)."""
    head = json.dumps({"obj": obj, "blobs": [len(b) for b in blobs]}, default=_plain).encode()
    data = memoryview(b"".join([_HEADER.pack(len(head)), head, *blobs]))
    while data:
        data = data[f.write(data):]


def _read_exact(f, n: int) -> bytes:
    """``n`` bytes from ``f``, an unbuffered pipe: nothing read ahead, so that ``select`` on it
    says whether a message is waiting."""
    chunks, left = [], n
    while left:
        chunk = f.read(left)
        if not chunk:
            raise EOFError("the other end closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(f) -> tuple[Any, list[bytes]]:
    """One message of :func:`_send`: its object and its blobs."""
    (n,) = _HEADER.unpack(_read_exact(f, _HEADER.size))
    head = json.loads(_read_exact(f, n))
    return head["obj"], [_read_exact(f, k) for k in head["blobs"]]


def _blob(blobs: list[bytes], batch: pa.RecordBatch | None) -> int | None:
    """Append ``batch`` to ``blobs`` as Arrow IPC (its index; None for no batch). Arrow's own
    format, not a per-column conversion: the parent's detection thread holds the GIL meanwhile."""
    if batch is None:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    blobs.append(sink.getvalue().to_pybytes())
    return len(blobs) - 1


def _batch(blobs: list[bytes], i: int | None) -> pa.RecordBatch | None:
    return None if i is None else pa.ipc.open_stream(blobs[i]).read_next_batch()  # the one batch _blob wrote


class _ChildGone(Exception):
    """The child exited, closed its pipe or did not answer in time."""


class ChildDetector(OnlineDetector):
    """An :class:`OnlineDetector` whose rules run in a child process (see the module's docstring).
    Raises at construction if the child cannot be started (the caller then detects in a thread)."""

    def __init__(self, config: DetectConfig | None = None, on_event: Callable[[dict], Any] | None = None):
        super().__init__(config, on_event)
        self.passes_in_child = 0  # passes the child answered
        self._ready = False  # the child's "ready" read
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=child_env(), bufsize=0)
        try:
            _send(self._proc.stdin, self.cfg.to_dict())
        except OSError as exc:
            self._stop()
            raise RuntimeError(f"the detection process did not start ({exc})") from exc

    def __repr__(self) -> str:
        where = "in a child process" if self._proc is not None else "in this process"
        return f"ChildDetector({where}, {len(self.events)} events)"

    @property
    def in_child(self) -> bool:
        """Whether the rules still run in the child."""
        return self._proc is not None

    def wait_ready(self) -> None:
        """Wait until the child has started (the detection thread calls this before its first pass;
        steps queued meanwhile are no lag of the detector's)."""
        if self._proc is not None and not self._ready:
            try:
                self._reply(self._proc, START_TIMEOUT_S)
                self._ready = True
            except _ChildGone as exc:
                self._gone(exc)

    def examine(self, steps: Sequence[Step]) -> list[dict]:
        self.wait_ready()
        if self._proc is not None:
            try:
                kind, value = self._ask(steps)
            except _ChildGone as exc:
                self._gone(exc)
            else:
                if kind == "error":  # the rules raised there: as if they had raised here
                    raise RuntimeError(value)
                self.passes_in_child += 1
                return value
        return super().examine(steps)

    def _ask(self, steps: Sequence[Step]) -> tuple[str, Any]:
        """One pass in the child: its steps sent, its reply read (:class:`_ChildGone` if it is gone)."""
        proc, blobs = self._proc, []
        index = [[int(step), int(rank)] + [_blob(blobs, b) for b in batches] for step, rank, *batches in steps]
        try:
            _send(proc.stdin, ["steps", index], blobs)
        except OSError as exc:
            raise self._lost(proc, exc) from exc
        return self._reply(proc, REPLY_TIMEOUT_S)

    def _reply(self, proc: subprocess.Popen, timeout_s: float) -> tuple[str, Any]:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            raise _ChildGone(f"no answer in {timeout_s:.0f} s")
        try:
            (kind, value), _ = _recv(proc.stdout)
        except (OSError, EOFError, ValueError, KeyError, struct.error) as exc:
            raise self._lost(proc, exc) from exc
        return kind, value

    @staticmethod
    def _lost(proc: subprocess.Popen, exc: BaseException) -> _ChildGone:
        try:
            status = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            status = None
        return _ChildGone(f"exit status {status}" if status is not None else f"{type(exc).__name__}: {exc}")

    def _gone(self, exc: _ChildGone) -> None:
        self._stop()
        warnings.warn(f"fp8scope: the online detection process stopped ({exc}); detection goes on in the "
                      "training process, its windows starting afresh", RuntimeWarning, stacklevel=3)

    def _stop(self) -> None:
        """Ask the child to leave, and close its pipes. Why a message and not only the pipe's end:
        a process forked from the training process after the child started (a data loader's
        worker) holds the pipe's write end too, so the child would not see it close."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            _send(proc.stdin, ["stop", None])
        except OSError:  # it had left
            pass
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the child (the detection thread has examined every step)."""
        self._stop()


def _wait_for_input(fd: int, parent: int) -> bool:
    """Block until stdin has data or closes (True), or the parent is gone (False)."""
    while True:
        ready, _, _ = select.select([fd], [], [], 2.0)
        if ready:
            return True
        if os.getppid() != parent:  # re-parented: the training process died without closing the pipe
            return False


def main() -> int:
    """Serve passes until told to stop, stdin closes or the parent is gone (exit status 0)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process, which closes the pipe
    parent = os.getppid()
    stdin, out = os.fdopen(0, "rb", buffering=0), os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    try:
        detector = OnlineDetector(DetectConfig.from_dict(_recv(stdin)[0]))
        _send(out, ["ready", None])
        while _wait_for_input(stdin.fileno(), parent):
            (kind, index), blobs = _recv(stdin)
            if kind == "stop":
                break
            try:
                steps = [(step, rank, _batch(blobs, t), _batch(blobs, sc)) for step, rank, t, sc in index]
                reply = ["events", detector.examine(steps)]
            except Exception as exc:
                reply = ["error", f"{type(exc).__name__}: {exc}"]
            _send(out, reply)
    except (EOFError, BrokenPipeError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
