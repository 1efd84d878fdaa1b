"""Build and load the one-pass CPU stats kernel (``fused_stats.c``) with the system C compiler.

Why a compiled kernel: on CPU, full stats written as torch ops take ~25 passes over each tensor
(see docs/benchmarks.md); the kernel reads each element once. It is optional: without a C
compiler, with ``FP8SCOPE_NATIVE=0``, or if the build fails, ``kernel()`` returns None and the
torch path in ``stats.py`` is used (same numbers, slower).

The shared object is built once per (source, compiler, CPU) into
``$FP8SCOPE_CACHE`` / ``$XDG_CACHE_HOME/fp8scope`` / ``~/.cache/fp8scope`` (written to a temporary
name and renamed, so concurrent ranks never load a half-written file). ``-march=native`` is
safe because the CPU's model and flags are part of the file name. Building takes about half a
second; the monitor starts it in a background thread (``build_in_background``) so no training
step ever waits for the compiler.

Threads: built with ``-fopenmp``, the library names ``libgomp.so.1``, which the dynamic loader
resolves to the copy torch already loaded, so large tensors are split over torch's own warm
OpenMP pool. Like torch's own ops, a parallel region cannot be used in a child forked after the
parent used the pool (GNU OpenMP is not fork-safe); with ``torch.set_num_threads(1)``, as torch's
DataLoader workers run, the kernel never enters one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("fused_stats.c")
ABI_VERSION = 6  # fp8s_abi_version() of the source this module knows how to call
# -ffp-contract=off: no fused multiply-add, so the error of a dequantized value is taken from the
# float32 value a consumer sees (as torch computes it), not from an exact intermediate
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]
_lock = threading.Lock()  # held while building
_flag_lock = threading.Lock()  # guards the "a background build was started" flag only: never blocks long
_state: dict = {"lib": None, "tried": False, "error": None}


def _cpu_signature() -> str:
    """Model name and feature flags of this CPU: a kernel built with -march=native runs only on its like."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _cache_dir() -> Path:
    if os.environ.get("FP8SCOPE_CACHE"):
        return Path(os.environ["FP8SCOPE_CACHE"]) / "native"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fp8scope" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def _flags(cpu: str) -> list[str]:
    """``_FLAGS``, plus 512-bit vectors where the CPU has AVX-512: gcc and clang prefer 256-bit ones
    by default even there, and the full-stats pass is compute-bound (15 % faster measured on the
    tiny GPT's tensors, 5.3 -> 4.5 ms a step)."""
    flags = list(_FLAGS)
    if platform.machine() in ("x86_64", "AMD64") and " avx512f" in cpu:
        flags.insert(2, "-mprefer-vector-width=512")
    return flags


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    src = _SOURCE.read_bytes()
    cpu = _cpu_signature()
    flags = _flags(cpu)
    key = hashlib.sha256(src + " ".join([cc] + flags).encode() + cpu.encode()).hexdigest()[:16]
    out = _cache_dir() / f"fused_stats-{key}.so"
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            where = out.parent
        except OSError:  # read-only home: build into a private temporary folder
            where = Path(tempfile.mkdtemp(prefix="fp8scope-native-"))
            out = where / out.name
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=where)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True,
                               timeout=120)
            if r.returncode != 0:
                errors = [ln for ln in (r.stderr or r.stdout).splitlines() if "error" in ln] or ["(no message)"]
                raise RuntimeError(f"{Path(cc).name} failed: {errors[0].strip()}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))  # releases the GIL: the full-stats pass may take milliseconds
    f = lib.fp8s_full_stats
    i64, p = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [p, ctypes.c_int, i64, i64, p, i64, p, i64, p, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    f.restype = ctypes.c_int
    # amax runs for every tensor of every what-if cheap step and takes microseconds: called through a
    # PyDLL handle it keeps the GIL, so the training thread does not hand the interpreter to the
    # monitor's other threads and wait to get it back 60 times a step (61 calls of the tiny GPT's
    # what-if step: 1.76 -> 1.53 ms in one measurement).
    a = lib.amax_keep_gil = ctypes.PyDLL(str(out)).fp8s_amax
    a.argtypes = [p, ctypes.c_int, i64, ctypes.c_int]
    a.restype = ctypes.c_double
    u = lib.delayed_update_keep_gil = ctypes.PyDLL(str(out)).fp8s_delayed_update  # microseconds too
    u.argtypes = [i64, i64, ctypes.c_int] + [p] * 11
    u.restype = None
    c = lib.bank_capture_keep_gil = ctypes.PyDLL(str(out)).fp8s_bank_capture  # every what-if cheap capture
    c.argtypes = [p, p, ctypes.c_int, i64, i64, i64, i64]
    c.restype = i64
    m = lib.fill_cheap_message_keep_gil = ctypes.PyDLL(str(out)).fp8s_fill_cheap_message  # every such step
    m.argtypes = [p, i64, p, p, i64, p, p, p, p, p]
    m.restype = ctypes.c_int
    q = lib.fp8s_quant_dequant
    q.argtypes = [p, i64, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int, p]
    q.restype = None
    if lib.fp8s_abi_version() != ABI_VERSION:
        raise RuntimeError("stale kernel build")
    return lib


def _env_enabled() -> bool:
    return os.environ.get("FP8SCOPE_NATIVE", "1").lower() not in ("0", "false", "no", "off")


_state["enabled"] = _env_enabled()


def enabled() -> bool:
    """Whether the kernel may be used (``FP8SCOPE_NATIVE=0`` at import, or ``set_enabled(False)``, says no)."""
    return _state["enabled"]


def set_enabled(on: bool) -> bool:
    """Switch the kernel on or off for this process (tests compare both paths); returns the old setting."""
    old, _state["enabled"] = _state["enabled"], bool(on)
    return old


def kernel(wait: bool = True) -> ctypes.CDLL | None:
    """The loaded kernel, building it if needed; None when unavailable (or still building and not ``wait``)."""
    if not enabled():
        return None
    if _state["tried"]:
        return _state["lib"]
    if not wait:
        build_in_background()
        return None
    with _lock:
        if not _state["tried"]:
            try:
                _state["lib"] = _build()
            except Exception as exc:  # the torch path takes over; say why once
                _state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"fp8scope: one-pass CPU stats kernel unavailable ({_state['error']}); "
                              "using the slower torch path", RuntimeWarning, stacklevel=2)
            _state["tried"] = True
        return _state["lib"]


_DTYPE_CODES: dict = {}  # torch dtype -> the kernel's element type (F32, BF16, F16 in fused_stats.c)


def dtype_codes() -> dict:
    """The whole table of :func:`dtype_code` (torch dtype -> code), for a caller on a hot path."""
    dtype_code(None)
    return _DTYPE_CODES


def dtype_code(dtype) -> int | None:
    """The kernel's code for a torch dtype, None for a dtype it does not read
    (torch is imported here, not at module import: readers never need it)."""
    if not _DTYPE_CODES:
        import torch

        _DTYPE_CODES.update({torch.float32: 0, torch.bfloat16: 1, torch.float16: 2})
    return _DTYPE_CODES.get(dtype)


def amax(x) -> float | None:
    """max |x| of a CPU tensor as a Python float (NaN if it holds a NaN) by one kernel pass; None
    where the kernel does not apply (not CPU, another dtype, not contiguous, kernel not built).

    Called per capture by host scaling states (``ScalingState``), so it does the least Python it
    can: the kernel function and the dtype table are looked up once (``_amax_fn``). (The what-if
    monitor's cheap captures take the whole way in C: ``bank_capture_fn``.)"""
    fn = _amax_fn()
    if fn is None or not x.is_cpu or not x.is_contiguous():
        return None
    code = _DTYPE_CODES.get(x.dtype)
    if code is None:
        return None
    return fn(x.data_ptr(), code, x.numel(), _torch.get_num_threads())


_torch = None  # torch, once amax has run (readers never import it)


def _amax_fn():
    """``fp8s_amax`` of the loaded kernel, or None (disabled, unavailable, still building)."""
    global _torch
    if not _state["enabled"]:
        return None
    fn = _state.get("amax_fn")
    if fn is None:
        lib = kernel(wait=False)
        if lib is None:
            return None
        import torch

        _torch = torch
        dtype_code(torch.float32)  # fills _DTYPE_CODES
        fn = _state["amax_fn"] = lib.amax_keep_gil
    return fn


def bank_capture_fn():
    """``fp8s_bank_capture`` of the loaded kernel, or None: the what-if monitor's whole cheap capture,
    ``fn(bank.ctx_address, data_ptr, dtype code, numel, slot, key id, after)``. It takes the amax of a
    contiguous CPU tensor, records it in the HostDelayedBank's ``slot`` (as ``bank.record``) and
    appends the row to the bank's row log; it returns the log's row count, or -1 when the log is
    full (nothing recorded)."""
    lib = kernel(wait=False) if enabled() else None
    return None if lib is None else lib.bank_capture_keep_gil


def fill_cheap_message_fn():
    """``fp8s_fill_cheap_message`` of the loaded kernel (a cheap what-if step's message from its row
    log, see ``step_records.cheap_log_message``), or None."""
    lib = kernel(wait=False) if enabled() else None
    return None if lib is None else lib.fill_cheap_message_keep_gil


def delayed_update_fn():
    """``fp8s_delayed_update`` of the loaded kernel (HostDelayedBank's update), or None."""
    lib = kernel(wait=False) if enabled() else None
    return None if lib is None else lib.delayed_update_keep_gil


def build_in_background() -> None:
    """Start building the kernel without waiting (once per process); the torch path serves until it is ready."""
    with _flag_lock:
        if not enabled() or _state["tried"] or _state.get("building"):
            return
        _state["building"] = True
    threading.Thread(target=kernel, name="fp8scope-native-build", daemon=True).start()


def status() -> str:
    """One line for ``fp8scope doctor``."""
    if not enabled():
        return "off (FP8SCOPE_NATIVE=0)"
    lib = kernel()
    return "built" if lib is not None else f"unavailable ({_state['error']})"
