"""The environment fp8scope's child processes start with (the compile child, the detection child).

Why: a child is ``python -m fp8scope...`` with the parent's interpreter, and it must import the same
fp8scope as the parent, also where fp8scope is not installed but found through the parent's
``sys.path`` (a source checkout, a test's copy of the tree). So the directory that holds the
parent's ``fp8scope`` package goes first on the child's ``PYTHONPATH``; the rest of the parent's
environment is kept."""

from __future__ import annotations

import os


def child_env(**extra: str) -> dict[str, str]:
    """The parent's environment, with its fp8scope importable first, and ``extra`` variables set."""
    import fp8scope

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fp8scope.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env
