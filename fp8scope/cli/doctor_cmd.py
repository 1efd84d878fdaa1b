"""``fp8scope doctor``: what this machine can do: torch, CUDA and FP8 GPU support, TE, torchao."""

from __future__ import annotations

import importlib.util
import platform
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def checks() -> list[tuple[str, str, bool | None]]:
    """(item, finding, ok) rows; ok None = informational."""
    import torch

    rows: list[tuple[str, str, bool | None]] = [
        ("python", platform.python_version(), None),
        ("torch", torch.__version__, True),
    ]
    fp8_dtypes = [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
                  if hasattr(torch, n)]
    rows.append(("torch fp8 dtypes", ", ".join(fp8_dtypes) or "none", bool(fp8_dtypes)))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            fp8 = cc >= (8, 9)
            rows.append((f"cuda:{i}", f"{torch.cuda.get_device_name(i)} (sm_{cc[0]}{cc[1]}): "
                         f"{'FP8 tensor cores' if fp8 else 'no FP8 tensor cores; emulated FP8 only'}", fp8))
        rows.append(("torch._scaled_mm", "available" if hasattr(torch, "_scaled_mm") else "missing",
                     hasattr(torch, "_scaled_mm")))
    else:
        rows.append(("cuda", "not available: emulated FP8 on CPU (fp8scope.emulate) works", None))
    te = importlib.util.find_spec("transformer_engine") is not None
    if te:
        try:
            import transformer_engine.pytorch  # noqa: F401

            rows.append(("transformer_engine", _version("transformer_engine") or "installed", True))
        except Exception as exc:  # TE needs CUDA: report why it won't load
            rows.append(("transformer_engine", f"installed but not importable: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120]}", False))
    else:
        rows.append(("transformer_engine", "not installed (pip install 'fp8scope[te]' on a CUDA machine)", None))
    rows.append(_compile_row())
    ao = _version("torchao")
    rows.append(("torchao", ao or "not installed (pip install 'fp8scope[torchao]')", True if ao else None))
    for dist in ("pyarrow", "duckdb", "pandas", "dash", "plotly", "tensorboard"):
        v = _version(dist)
        rows.append((dist, v or "not installed", True if v else (None if dist in ("dash", "plotly", "tensorboard") else False)))
    return rows


def _compile_row() -> tuple[str, str, bool | None]:
    """Whether the stats pass can be compiled here (inductor: Triton on CUDA, a C++ compiler on the CPU)."""
    from fp8scope.compiled import compile_mode

    mode = compile_mode()
    if mode == "off":
        return ("compiled stats pass", "off (FP8SCOPE_COMPILE=0): stats run as eager torch ops", None)
    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:
        return ("compiled stats pass", f"inductor unavailable ({type(exc).__name__}); stats run eagerly", None)
    how = {"auto": "on GPUs, ahead in a compile child; eager on the CPU (FP8SCOPE_COMPILE=1 compiles there too)",
           "on": "on every device: ahead in a compile child on GPUs, at first use on the CPU",
           "sync": "on every device, each variant at its first use on the calling thread (FP8SCOPE_COMPILE=sync)",
           "ahead": "on every device, ahead in a compile child (FP8SCOPE_COMPILE=ahead)"}[mode]
    return ("compiled stats pass", f"on: {how}", True)


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check torch, CUDA/FP8 GPU support, Transformer Engine and torchao")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="fp8scope doctor")
    table.add_column("")
    table.add_column("item")
    table.add_column("finding", overflow="fold")
    rows = checks()
    for item, finding, ok in rows:
        mark = "[green]ok[/green]" if ok else ("[red]missing[/red]" if ok is False else "[dim]info[/dim]")
        table.add_row(mark, Text(item), Text(finding))
    Console(highlight=False).print(table)
    return 0 if all(ok is not False for _, _, ok in rows if _ in ("torch", "pyarrow", "duckdb", "pandas")) else 1
