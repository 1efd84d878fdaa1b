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
from fp8scope.monitor import Monitor
from fp8scope.run import Run, load_run

__all__ = ["Monitor", "load_run", "Run", "Fp8ScopeError", "RunError", "UsageError", "__version__"]
