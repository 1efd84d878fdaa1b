"""Load (CI variant): 8 writer processes x 2,000 tensors per step while the CLI, load_run().refresh()
and the dashboard's data layer read the same run: no reader error. The timing comparison (writers
not slowed) is a benchmark: benchmarks/reliability_load.py, numbers in docs/reliability.md."""

from __future__ import annotations

import importlib.util

from rel_common import ROOT


def test_readers_never_fail_under_8_writers(tmp_path):
    spec = importlib.util.spec_from_file_location("reliability_load", ROOT / "benchmarks" / "reliability_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        import dashboard.queries  # noqa: F401
        readers = ("cli", "api", "dashboard")
    except Exception:
        readers = ("cli", "api")
    res = mod.run_load(writers=8, tensors=2000, phase_s=4.0, rounds=1, step_ms=100.0, readers=readers,
                       work=str(tmp_path), warmup_s=5.0)
    assert res["reader_errors"] == [], res["reader_errors"][:5]
    assert all(res["reads"][k] >= 1 for k in readers), res["reads"]
    assert res["rows_written"]["tensors"] >= 8 * 2000 * 10
