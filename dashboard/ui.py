"""Small Dash building blocks shared by the pages: links, notes, tables, graphs, number formats.

Text from runs (layer names, messages, rule names) only ever goes into Dash components as text
children (escaped by React) or into plotly labels through :func:`plot_label`, which neutralises the
characters plotly's pseudo-HTML label parser reads ('<', '>' and '&' entities). No raw HTML, no
markdown with run data.
"""

from __future__ import annotations

import logging
import time
import traceback
from urllib.parse import urlencode

import numpy as np
from dash import dcc, html

from dashboard.paths import PathRejected
from dashboard.rollup import NoData
from fp8scope.errors import Fp8ScopeError

log = logging.getLogger("fp8scope.dashboard")

RUN_COLORS = ("#1f77b4", "#ff7f0e")  # run A, run B: one colour per run everywhere on Compare


def _default_template() -> None:
    """Every figure of the dashboard server on plotly_white, set once: setting it per figure deep-copies
    and validates the template each time, which was most of a page's server time."""
    import plotly.io as pio

    pio.templates.default = "plotly_white"


_default_template()


def plot_label(s) -> str:
    """Text shown literally in plotly labels and hovers (plotly parses a subset of HTML there: tags and
    entities such as ``&amp;``)."""
    return str(s).replace("&", "&amp;").replace("<", "\u2039").replace(">", "\u203a")


def link(text, **params) -> dcc.Link:
    q = {k: v for k, v in params.items() if v not in (None, "")}
    return dcc.Link(text, href="/?" + urlencode(q))


def note(text, id=None) -> html.Div:
    return html.Div(text, className="note", **({"id": id} if id else {}))


def error_card(title: str, msg: str) -> html.Div:
    return html.Div([html.B(title), html.Div(msg)], className="error-card")


def panel(fn, *args, **kw):
    """Build one panel; data problems become a note or an error card, never a traceback."""
    try:
        out = fn(*args, **kw)
        return html.Div(out) if isinstance(out, (list, tuple)) else out  # Dash children cannot nest lists
    except NoData as e:
        return note(str(e))
    except PathRejected as e:
        return error_card("Refused", str(e))
    except Fp8ScopeError as e:
        return error_card("This run could not be read", str(e).splitlines()[0] if str(e) else type(e).__name__)
    except Exception as e:  # noqa: BLE001 - a broken panel must not take the app down
        log.warning("panel failed: %s", traceback.format_exc())
        return error_card("This panel failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def ago(t: float | None) -> str:
    if t is None:
        return "never"
    d = max(0.0, time.time() - t)
    if d < 90:
        return f"{d:.0f} s ago"
    if d < 5400:
        return f"{d / 60:.0f} min ago"
    if d < 2 * 86400:
        return f"{d / 3600:.1f} h ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt(v, spec=".3g") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def ctl(name: str, component_cls, label: str, **kw):
    return html.Div([html.Label(label), component_cls(id={"type": "ctl", "name": name}, **kw)])


def table(columns: list[str], rows: list[list], num_cols: set[int] | None = None, id=None,
          wrap_cols: set[int] | None = None) -> html.Div:
    """A plain table in a horizontally scrolling box (never wider than the page); ``wrap_cols`` wrap
    their text (messages) instead of stretching the row."""
    num_cols, wrap_cols = num_cols or set(), wrap_cols or set()

    def cls(i):
        return "num" if i in num_cols else ("wrap" if i in wrap_cols else None)

    head = html.Thead(html.Tr([html.Th(c) for c in columns]))
    body = html.Tbody([html.Tr([html.Td(v, className=cls(i)) for i, v in enumerate(r)]) for r in rows])
    kw = {"id": id} if id else {}
    return html.Div(html.Table([head, body], className="grid", **kw), className="tablebox")


def data_table(id: str, columns: list[str], rows: list[list], num_cols: set[int] | None = None,
               wrap_cols: set[int] | None = None, page_size: int = 25, hidden: list[str] | None = None):
    """A big table as one component (dash_table.DataTable: rows drawn by one React component, paged in
    the browser): ~100 rows of html.Td / dcc.Link components cost Chromium seconds to lay out. Cells are
    plain text (no markdown); clicking a row is wired by the page (``active_cell``). ``hidden``: columns
    kept in the row data (for the click) but not shown."""
    from dash import dash_table

    num_cols, wrap_cols = num_cols or set(), wrap_cols or set()
    data = [{c: ("" if v is None else v) for c, v in zip(columns, r)} for r in rows]
    return dash_table.DataTable(
        id=id, data=data, columns=[{"name": c, "id": c} for c in columns if c not in (hidden or [])],
        page_size=page_size, page_action="native" if len(rows) > page_size else "none", sort_action="none",
        cell_selectable=True, style_as_list_view=True,
        style_table={"overflowX": "auto", "maxWidth": "100%"},
        style_header={"backgroundColor": "#eef1f5", "fontWeight": 600},
        style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 8px", "textAlign": "left",
                    "whiteSpace": "nowrap", "cursor": "pointer"},
        style_cell_conditional=[{"if": {"column_id": columns[i]}, "textAlign": "right"} for i in num_cols]
        + [{"if": {"column_id": columns[i]}, "whiteSpace": "normal", "minWidth": "260px", "maxWidth": "640px"}
           for i in wrap_cols],
        style_data_conditional=[{"if": {"filter_query": '{severity} = "critical"'}, "backgroundColor": "#fde8e7"},
                                {"if": {"filter_query": '{severity} = "warning"'}, "backgroundColor": "#fff6e0"}]
        if "severity" in columns else [])


def log_axis(**kw) -> dict:
    """A log axis with unambiguous ticks: decades only, written as powers of ten."""
    return {"type": "log", "dtick": 1, "exponentformat": "power", **kw}


def graph(fig, id=None, **kw):
    kwargs = {"figure": fig, "config": {"displaylogo": False}}
    if id:
        kwargs["id"] = id
    kwargs.update(kw)
    return dcc.Graph(**kwargs)
