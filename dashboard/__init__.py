"""fp8scope web dashboard (Dash): ``fp8scope dashboard RUNS_ROOT``. See docs/dashboard.md."""

from __future__ import annotations


def create_app(root, interval_ms: int = 1500):
    from dashboard.app import create_app as _create

    return _create(root, interval_ms)
