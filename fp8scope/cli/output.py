"""Terminal output helpers shared by the sub-commands: rich tables, sizes, JSON."""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING, Any, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # the commands that print no frame (info) do not import pandas (a noticeable part of a quick command)
    import pandas as pd


def console() -> Console:
    # Wide enough for tables when piped; rich escapes markup in cell text we pass as Text.
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fmt_value(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is getattr(sys.modules.get("pandas"), "NA", None):
        return "-"
    if isinstance(v, float):
        if v == 0 or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def print_frame(df: pd.DataFrame, title: str | None = None, columns: Iterable[str] | None = None) -> None:
    import pandas as pd

    cols = list(columns) if columns is not None else list(df.columns)
    table = Table(title=title, show_lines=False)
    for c in cols:
        table.add_column(c, justify="right" if pd.api.types.is_numeric_dtype(df[c]) else "left", overflow="fold")
    for row in df[cols].itertuples(index=False):
        table.add_row(*[Text(fmt_value(v)) for v in row])  # Text: names are never parsed as markup
    console().print(table)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default, allow_nan=False) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)
