"""``fp8scope info RUN``: what a run folder holds (steps, ranks, tensors, size, last step)."""

from __future__ import annotations

import time

from fp8scope.cli.output import console, human_size, print_json
from fp8scope.run import load_run
from fp8scope.store.manifest import coverage_of, coverage_text, describe_mode, measured_mode, recipe_text


def register(sub) -> None:
    p = sub.add_parser("info", help="summary of a run: steps, ranks, tensors, size, last step")
    p.add_argument("run", help="run folder")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    # one query per process: read the streams zero-copy instead of copying the run into memory first
    # (6.4M rows: 0.24 s instead of 2.9 s, and ~1.5 GB less memory)
    r = load_run(args.run, combine_chunks=False)
    info = r.info()
    mode = measured_mode(r.manifest)
    if args.json:
        print_json({**info, "recipe": r.manifest.get("recipe"), "measured": mode, "coverage": coverage_text(r.manifest)})
        return 0
    c = console()
    age = f"{time.time() - info['last_write']:.0f} s ago" if info.get("last_write") else "never"
    rows = [
        ("run", info["path"]),
        ("steps", f"{info['steps']} (first {info['first_step']}, last {info['last_step']})"),
        ("ranks", f"{len(info['ranks'])} logged {info['ranks']} of world size {info['world_size']}"),
        ("tensors", str(info["tensors"])),
        ("segments", str(info["segments"])),
        ("rows", ", ".join(f"{k}: {v}" for k, v in info["tables"].items()) or "-"),
        ("size", human_size(info["size_bytes"])),
        ("last write", age),
        ("compacted", "yes" if info["compacted"] else "no"),
        ("measured", describe_mode(mode)),
        ("coverage", coverage_text(r.manifest) or ("every module holding GEMM weights" if coverage_of(r.manifest)
                                                   else "not recorded")),
        ("recipe", recipe_text(r.manifest.get("recipe"))),
        ("what-if", recipe_text(mode["whatif_recipe"])),
        ("torch", str(r.manifest.get("torch_version"))),
    ]
    for k, v in rows:
        c.print(f"[bold]{k:>11}[/bold]  ", end="")
        c.print(v, markup=False)
    return 0
