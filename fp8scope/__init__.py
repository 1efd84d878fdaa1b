"""fp8scope: why an FP8 training run is unstable, where, and whether FP8 is to blame.

Capture::

    with fp8scope.Monitor(model, run_dir="runs/exp1") as mon:
        for batch in loader:
            ...
            mon.step(loss=loss)

Read::

    run = fp8scope.load_run("runs/exp1")
    run.tensors(); run.scalars(); run.sql("SELECT ...")
"""

__version__ = "0.1.0"

from fp8scope.errors import Fp8ScopeError, RunError, UsageError
from fp8scope.priority import yield_to_training

# Loaded on first use: reading a run (CLI, dashboard) must not pay torch's import time.
_LAZY = {"Monitor": "fp8scope.monitor", "load_run": "fp8scope.run", "Run": "fp8scope.run", "Shadow": "fp8scope.shadow",
         "register_linear_like": "fp8scope.linear_like"}

__all__ = ["Monitor", "load_run", "Run", "Shadow", "Fp8ScopeError", "RunError", "UsageError", "yield_to_training",
           "register_linear_like", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp8scope' has no attribute {name!r}")
