"""run.json: what a run is (versions, recipe, world size, monitored tensors), read and written atomically.

The manifest is small and rewritten whole; it is replaced atomically so a crash never
leaves a torn run.json, and every read validates it so a hand-edited or foreign file gives
one clear line instead of a KeyError deep inside a dashboard.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from fp8scope import __version__
from fp8scope.errors import RunError
from fp8scope.schema import SCHEMA_VERSION
from fp8scope.store.atomic import atomic_write_bytes
from fp8scope.store.layout import MANIFEST, manifest_path

TENSOR_KEYS = ("layer", "tensor", "shape", "fp8_format", "source", "recipe")


def _torch_version() -> str | None:
    # importlib.metadata, not `import torch`: reading a run must not pay torch's import time.
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def new_manifest(
    *,
    recipe: dict | None = None,
    world_size: int = 1,
    tensors: list[dict] | None = None,
    meta: dict | None = None,
) -> dict:
    """A complete manifest with versions and creation time filled in."""
    return {
        "schema_version": SCHEMA_VERSION,
        "fp8scope_version": __version__,
        "torch_version": _torch_version(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe,
        "world_size": int(world_size),
        "tensors": list(tensors or []),
        "meta": dict(meta or {}),
    }


def _complete(manifest: dict) -> dict:
    out = new_manifest()
    out.update(manifest)
    return out


def validate_manifest(m: Any, where: str) -> dict:
    """Check structure and types; raise RunError naming the first problem, in one line."""
    if not isinstance(m, dict):
        raise RunError(f"{where}: {MANIFEST} is not a JSON object")
    if "schema_version" not in m:
        raise RunError(f"{where}: {MANIFEST} has no schema_version (not an fp8scope run?)")
    v = m["schema_version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise RunError(f"{where}: {MANIFEST} schema_version must be an integer, got {v!r}")
    if v > SCHEMA_VERSION:
        raise RunError(
            f"{where}: schema version {v} is newer than this fp8scope supports ({SCHEMA_VERSION}); upgrade fp8scope"
        )
    if v < 1:
        raise RunError(f"{where}: {MANIFEST} schema_version {v} is invalid")
    ws = m.get("world_size", 1)
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise RunError(f"{where}: {MANIFEST} world_size must be a positive integer, got {ws!r}")
    recipe = m.get("recipe")
    if recipe is not None and not isinstance(recipe, dict):
        raise RunError(f"{where}: {MANIFEST} recipe must be an object or null, got {type(recipe).__name__}")
    meta = m.get("meta", {})
    if not isinstance(meta, dict):
        raise RunError(f"{where}: {MANIFEST} meta must be an object, got {type(meta).__name__}")
    tensors = m.get("tensors", [])
    if not isinstance(tensors, list):
        raise RunError(f"{where}: {MANIFEST} tensors must be a list, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            raise RunError(f"{where}: {MANIFEST} tensors[{i}] must be an object")
        for k in ("layer", "tensor"):
            if not isinstance(t.get(k), str):
                raise RunError(f"{where}: {MANIFEST} tensors[{i}] has no string {k!r}")
        shape = t.get("shape")
        if shape is not None and not (isinstance(shape, list) and all(isinstance(d, int) for d in shape)):
            raise RunError(f"{where}: {MANIFEST} tensors[{i}].shape must be a list of integers")
    m.setdefault("world_size", ws)
    m.setdefault("recipe", None)
    m.setdefault("meta", {})
    m.setdefault("tensors", [])
    return m


def write_manifest(run_dir: str | os.PathLike, manifest: dict) -> dict:
    """Validate, fill in missing version fields, and atomically (re)write run_dir/run.json.

    Creates run_dir if needed. Returns the manifest as written.
    """
    run_dir = Path(run_dir)
    # Round-trip through JSON first so tuples/torch.Size/numpy values validate as what will be read back.
    m = json.loads(json.dumps(_complete(manifest), default=_json_default))
    m = validate_manifest(m, str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps(m, indent=2).encode() + b"\n"
    atomic_write_bytes(manifest_path(run_dir), data)
    return m


def _json_default(o: Any) -> Any:
    # shapes as torch.Size / tuples, numpy scalars: make them JSON without the caller converting.
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    for attr in ("tolist", "item"):
        if hasattr(o, attr):
            return getattr(o, attr)()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def read_manifest(run_dir: str | os.PathLike) -> dict:
    """Read and validate run.json; every failure is a RunError with a one-line message."""
    where = str(run_dir)
    p = manifest_path(run_dir)
    if not Path(run_dir).exists():
        raise RunError(f"{where}: no such run folder")
    if not Path(run_dir).is_dir():
        raise RunError(f"{where}: not a folder")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise RunError(f"{where}: not an fp8scope run (no {MANIFEST})") from None
    except OSError as e:
        raise RunError(f"{where}: cannot read {MANIFEST} ({e.strerror or e})") from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunError(f"{where}: {MANIFEST} is not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise RunError(f"{where}: {MANIFEST} is not valid JSON (line {e.lineno})") from None
    except (ValueError, RecursionError) as e:  # a 5000-digit number, nesting deeper than the stack
        raise RunError(f"{where}: {MANIFEST} is not a usable JSON document ({type(e).__name__})") from None
    return validate_manifest(m, where)


def update_manifest(run_dir: str | os.PathLike, **changes: Any) -> dict:
    """Read, apply top-level changes ("meta" is merged, not replaced), rewrite atomically.

    Single-writer by design (rank 0 owns run.json); concurrent updaters race, last one wins.
    """
    m = read_manifest(run_dir)
    if "meta" in changes and isinstance(changes["meta"], dict):
        meta = dict(m.get("meta") or {})
        meta.update(changes.pop("meta"))
        m["meta"] = meta
    m.update(changes)
    return write_manifest(run_dir, m)


def recipe_text(recipe: dict | None) -> str:
    """``delayed (fp8_format=HYBRID, margin=0, ...)`` for a recipe's ``to_dict()``; ``-`` for none."""
    if not recipe:
        return "-"
    rest = ", ".join(f"{k}={v}" for k, v in recipe.items() if k != "kind")
    return f"{recipe.get('kind', 'recipe')} ({rest})" if rest else str(recipe.get("kind", "recipe"))


def measured_mode(manifest: dict) -> dict:
    """What a run's FP8 numbers are, from the layers the monitor attached to (``meta.sources``):

    - ``"fp8"``: every monitored layer ran FP8 (emulated, torchao, Transformer Engine);
    - ``"whatif"``: none did: the model trained in high precision and every FP8 number is what
      the what-if recipe would have done to its tensors;
    - ``"mixed"``: some of each; ``"unknown"``: a run that recorded no sources."""
    meta = manifest.get("meta") or {}
    sources = {str(k): int(v) for k, v in (meta.get("sources") or {}).items()}
    whatif = sources.get("whatif", 0)
    fp8 = sum(v for k, v in sources.items() if k != "whatif")
    kind = ("mixed" if fp8 and whatif else "fp8" if fp8 else "whatif" if whatif else "unknown")
    return {"kind": kind, "fp8_layers": fp8, "whatif_layers": whatif, "sources": sources,
            "recipe": manifest.get("recipe"), "whatif_recipe": meta.get("whatif_recipe") if whatif else None}


def describe_mode(mode: dict) -> str:
    """One sentence saying what was measured, for ``info`` and the report (the recipes are shown
    beside it, with :func:`recipe_text`)."""
    kind = mode["kind"]
    if kind == "whatif":
        return (f"what-if: the model trained without FP8 ({mode['whatif_layers']} layers in high precision); the FP8 "
                "statistics and events are what the what-if recipe would have done, not what training computed")
    fp8 = ", ".join(f"{n} {k}" for k, n in mode["sources"].items() if k != "whatif")
    if kind == "fp8":
        return f"FP8: {mode['fp8_layers']} layers ran FP8 ({fp8})"
    if kind == "mixed":
        return (f"mixed: {mode['fp8_layers']} layers ran FP8 ({fp8}); {mode['whatif_layers']} high-precision layers "
                "measured what-if")
    return "unknown: the run does not say which layers ran FP8"


def share_text(part: int, total: int) -> str:
    """``part`` of ``total`` as a whole percentage; "<1 %" for a share that is there but rounds to 0."""
    pct = 100 * part / total if total else 0.0
    return "<1 %" if 0 < pct < 0.5 else f"{pct:.0f} %"


def coverage_of(manifest: dict) -> dict:
    """run.json's ``meta.coverage`` (``fp8scope.coverage``): the modules holding GEMM weights that
    the monitor left, and how much of those weights the monitored layers hold; {} for a run logged
    before it was recorded."""
    cov = (manifest.get("meta") or {}).get("coverage")
    return cov if isinstance(cov, dict) else {}


def coverage_text(manifest: dict) -> str | None:
    """One sentence naming what the monitor did not see, for ``info``, the report and the dashboard;
    None when it saw every module holding GEMM weights (or the run does not say)."""
    cov = coverage_of(manifest)
    # routers are recorded (a NaN may start there) but not named: every FP8 recipe keeps them in high precision
    left = [u for u in cov.get("unmonitored") or [] if isinstance(u, dict) and u.get("kind") != "router"]
    if not left:
        return None
    p = cov.get("params") or {}
    total = int(p.get("monitored") or 0) + int(p.get("unmonitored") or 0)
    parts = []
    for kind, one, many in (("experts", "MoE expert module", "MoE expert modules"),
                            ("matrix", "other weight matrix", "other weight matrices"),
                            ("idle", "layer whose forward never ran", "layers whose forward never ran")):
        group = [u for u in left if u.get("kind") == kind]
        if group:
            share = f", {share_text(sum(int(u.get('params') or 0) for u in group), total)} of the GEMM weights" if total else ""
            names = ", ".join(str(u.get("module")) for u in group[:3]) + (f" and {len(group) - 3} more" if len(group) > 3 else "")
            parts.append(f"{len(group)} {one if len(group) == 1 else many} ({names}{share})")
    return "not monitored: " + "; ".join(parts)
