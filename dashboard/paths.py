"""Which folders the dashboard may serve: only run folders under RUNS_ROOT.

Every run name that arrives from the browser (URL query, dropdown value) goes through
:meth:`RunsRoot.resolve`. A name is a '/'-separated path relative to the root; absolute
paths, '..', backslashes, NUL and anything whose *resolved* path (symlinks followed)
lies outside the resolved root are refused. Only folders holding a ``run.json`` count.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fp8scope.store.layout import MANIFEST

MAX_DEPTH = 3  # runs may sit in sub-folders (root/sweep/run-3), but not arbitrarily deep
_SAFE_PART = re.compile(r"^[^\x00-\x1f/\\]+$")


class PathRejected(ValueError):
    """A run name that does not name a run folder under the root."""


class RunsRoot:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()

    def _is_inside(self, p: Path) -> bool:
        try:
            p.relative_to(self.root)
            return True
        except ValueError:
            return False

    def resolve(self, name: str | None) -> Path:
        """The run folder for `name`, or PathRejected (message safe to show)."""
        if not isinstance(name, str) or not name or len(name) > 1000:
            raise PathRejected("no run name given")
        if name.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", name) or "\\" in name or "\x00" in name:
            raise PathRejected("run names are paths relative to the runs root")
        parts = name.split("/")
        if len(parts) > MAX_DEPTH or any(p in ("", ".", "..") or not _SAFE_PART.match(p) for p in parts):
            raise PathRejected("run names may not contain '.', '..' or empty parts")
        candidate = self.root.joinpath(*parts)
        real = candidate.resolve()  # follows symlinks
        if not self._is_inside(real) or real == self.root:
            raise PathRejected("run name points outside the runs root")
        if not real.is_dir():
            raise PathRejected("no such run under the runs root")
        if not (real / MANIFEST).is_file():
            raise PathRejected("not a run folder (no run.json)")
        return real

    def name_of(self, path: Path) -> str:
        return Path(path).resolve().relative_to(self.root).as_posix()

    def list_runs(self) -> list[str]:
        """Run names under the root (folders with run.json, at most MAX_DEPTH deep, never escaping the root)."""
        out: list[str] = []

        def walk(d: Path, depth: int) -> None:
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                return
            for e in entries:
                if e.name.startswith(".") or not e.is_dir():
                    continue
                p = Path(e.path)
                real = p.resolve()
                if not self._is_inside(real):
                    continue  # symlink out of the root: never listed, never served
                if (real / MANIFEST).is_file():
                    out.append(p.relative_to(self.root).as_posix())
                elif depth < MAX_DEPTH:
                    walk(p, depth + 1)

        walk(self.root, 1)
        return out
