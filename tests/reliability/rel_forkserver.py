"""Fork server for the crash tests: pays the torch import once, then forks one child per job.

stdin: one JSON job per line. stdout: JSON lines, each tagged with the job id:
  {"id": ..., "pid": ...}             the child was forked
  {"id": ..., "ret": step}            `step` is durable: the child's mon.step() for the step after it
                                      returned (steps are written one behind, on every device)
  {"id": ..., "done": rc}             the child finished on its own (clean end, compaction done)
Children are reaped automatically (SIGCHLD ignored); the test kills them with SIGKILL.

Jobs:
  {"op": "train", "id", "run", "life", "start", "stop", "every", "tear": [n, frac] | null,
   "tear_manifest": bool}
      Monitor(step=start) on `run`; logs scalar life=<life> every step. `tear=[n, frac]` makes
      the n-th stream write put only `frac` of its bytes on disk and then SIGKILL itself
      (a kill in the middle of a flush). `tear_manifest` does the same inside run.json's
      atomic rewrite.
  {"op": "compact", "id", "run", "delete": bool}: `fp8scope compact RUN` (the CLI's main).
  {"op": "storage", "id", "run", "steps", "fsize": bytes | null, "uid": int | null, "pace": seconds}
      the faulty-storage trainer: optional RLIMIT_FSIZE (SIGXFSZ ignored, so writes fail with
      EFBIG like a full disk) and setuid (permissions enforced); reports {"step": n} after each
      step and {"summary": {steps_done, ok_steps, warnings, logging_failed}} at the end.
"""

import json
import os
import resource
import signal
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402  (the expensive import, paid once)

import fp8scope  # noqa: E402
import fp8scope.store.manifest as manifest_mod  # noqa: E402
import fp8scope.store.writer as writer_mod  # noqa: E402
from fp8scope.cli.main import main as cli_main  # noqa: E402
from fp8scope.emulate import DelayedScaling, convert_to_fp8  # noqa: E402
from tests.conftest import MLP  # noqa: E402

signal.signal(signal.SIGCHLD, signal.SIG_IGN)


def emit(obj) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())  # one write(2) < PIPE_BUF: lines never interleave


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def train(job) -> None:
    torch.set_num_threads(1)
    tear = job.get("tear")
    if tear:
        n_target, frac = int(tear[0]), float(tear[1])
        orig = writer_mod._write_all
        calls = [0]

        def torn_write_all(fd, data):
            calls[0] += 1
            if calls[0] == n_target:
                view = memoryview(data)
                k = int(len(view) * frac)
                if k:
                    os.write(fd, view[:k])
                die()
            orig(fd, data)

        writer_mod._write_all = torn_write_all
    if job.get("tear_manifest"):
        def torn_atomic(path, data):
            from fp8scope.store.atomic import tmp_name

            with open(tmp_name(path), "wb") as f:
                f.write(data[: len(data) // 2])
            die()

        manifest_mod.atomic_write_bytes = torn_atomic
    torch.manual_seed(job["life"])
    m = convert_to_fp8(MLP(d=64, h=256, out=64), recipe=DelayedScaling(amax_history_len=8))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    mon = fp8scope.Monitor(m, job["run"], every=job.get("every", 2), step=job["start"])
    for step in range(job["start"], job["stop"]):
        loss = m(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach(), life=job["life"])
        if step > job["start"]:
            emit({"id": job["id"], "ret": step - 1})
    mon.close()


def storage(job) -> None:
    if job.get("fsize"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], job["fsize"]))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = convert_to_fp8(MLP(d=32, h=64, out=16), recipe=DelayedScaling(amax_history_len=4))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    if job.get("uid") is not None:
        # A warm-up step first, as root: the stdlib here lives under /root, which `nobody` cannot
        # read, so every lazy import must already have happened before we drop privileges.
        import tempfile

        with fp8scope.Monitor(m, tempfile.mkdtemp(), every=1) as warm:
            m(torch.randn(16, 32)).pow(2).mean().backward()
            opt.zero_grad()
            warm.step(loss=0.0)
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    ok_steps, done = [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(m, job["run"], every=1, step=0)
        for step in range(job["steps"]):
            loss = m(torch.randn(16, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
            # step() returns once the previous step is written: that one is durable if logging still works
            if mon.logging_failed is None and step > 0:
                ok_steps.append(step - 1)
            done += 1
            emit({"id": job["id"], "step": step})
            time.sleep(job.get("pace", 0))
        mon.close()
        if mon.logging_failed is None and done:
            ok_steps.append(done - 1)  # close() wrote the last one
    msgs = [str(w.message) for w in caught if "fp8scope" in str(w.message)]
    emit({"id": job["id"], "summary": {"steps_done": done, "ok_steps": ok_steps, "warnings": msgs,
                                       "logging_failed": mon.logging_failed}})


def compact(job) -> int:
    argv = ["compact", job["run"]] + (["--delete-streams"] if job.get("delete") else [])
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)  # the CLI's own output must not mix into the protocol
        return cli_main(argv)


def child(job) -> int:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if job["op"] == "train":
        train(job)
        return 0
    if job["op"] == "storage":
        storage(job)
        return 0
    if job["op"] == "compact":
        out = os.dup(1)
        rc = compact(job)
        os.dup2(out, 1)
        return rc
    return 3


for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            rc = child(job)
        except BaseException as exc:  # noqa: BLE001 - report, never hang the test
            emit({"id": job["id"], "error": f"{type(exc).__name__}: {exc}"})
        emit({"id": job["id"], "done": rc})
        os._exit(0)
    emit({"id": job["id"], "pid": pid})
