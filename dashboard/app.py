"""The Dash app: URL-driven views over the runs under one root.

All state lives in the URL query (``?run=NAME&view=heatmap&stat=headroom&role=activation``),
so every view is a link that can be shared or reloaded. One callback renders the page from
the URL; controls rewrite the URL; a ``dcc.Interval`` refreshes the runs named in the URL
(reading only new bytes) and bumps a version number that re-renders the page when, and
only when, the data changed.

Text from runs (layer names, messages, rule names) only ever goes into Dash components as
text children (escaped by React) or into plotly labels through :func:`plot_label`, which
replaces '<' and '>' so plotly's pseudo-HTML label parser sees no tags. No raw HTML, no
markdown with run data.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path
from urllib.parse import parse_qs, urlencode

import numpy as np
import pandas as pd
from dash import ALL, Dash, Input, Output, State, ctx, dcc, html, no_update

from dashboard import data as D
from dashboard.paths import PathRejected, RunsRoot
from fp8scope.errors import Fp8ScopeError

log = logging.getLogger("fp8scope.dashboard")

VIEWS = [("runs", "Runs"), ("overview", "Overview"), ("heatmap", "Heatmap"), ("outliers", "Outlier layers"),
         ("tensor", "Tensor"), ("compare", "Compare"), ("live", "Live")]
PARAMS = ("view", "run", "b", "stat", "role", "agg", "layer", "q")


def _figures():
    try:
        import fp8scope.figures as F  # shared with the HTML report

        return F
    except ImportError:  # pragma: no cover - older checkout
        from dashboard import _figures_fallback as F

        return F


def plot_label(s) -> str:
    """Text safe for plotly labels (plotly parses a subset of HTML tags in labels and hovers)."""
    return str(s).replace("<", "\u2039").replace(">", "\u203a")


# ---- small UI helpers ----------------------------------------------------------------------
def link(text, **params) -> dcc.Link:
    q = {k: v for k, v in params.items() if v not in (None, "")}
    return dcc.Link(text, href="/?" + urlencode(q))


def note(text) -> html.Div:
    return html.Div(text, className="note")


def error_card(title: str, msg: str) -> html.Div:
    return html.Div([html.B(title), html.Div(msg)], className="error-card")


def panel(fn, *args, **kw):
    """Build one panel; data problems become a note or an error card, never a traceback."""
    try:
        out = fn(*args, **kw)
        return html.Div(out) if isinstance(out, (list, tuple)) else out  # Dash children cannot nest lists
    except D.NoData as e:
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


def table(columns: list[str], rows: list[list], num_cols: set[int] | None = None, id=None) -> html.Table:
    num_cols = num_cols or set()
    head = html.Thead(html.Tr([html.Th(c) for c in columns]))
    body = html.Tbody([html.Tr([html.Td(v, className="num" if i in num_cols else None) for i, v in enumerate(r)])
                       for r in rows])
    kw = {"id": id} if id else {}
    return html.Table([head, body], className="grid", **kw)


def graph(fig, id=None, **kw):
    fig.update_layout(template="plotly_white")
    kwargs = {"figure": fig, "config": {"displaylogo": False}}
    if id:
        kwargs["id"] = id
    kwargs.update(kw)
    return dcc.Graph(**kwargs)


# ---- the app --------------------------------------------------------------------------------
class DashboardApp:
    def __init__(self, root: str | Path, interval_ms: int = 2000):
        self.root = RunsRoot(root)
        self.cache = D.RunCache()
        self.interval_ms = interval_ms
        self.app = Dash(
            __name__,
            title="fp8scope",
            suppress_callback_exceptions=True,
            assets_folder=str(Path(__file__).parent / "assets"),
            update_title=None,
        )
        self.app.layout = self.layout
        self._callbacks()

    # -- layout ---------------------------------------------------------------------------
    def layout(self):
        return html.Div([
            dcc.Location(id="url", refresh=False),
            dcc.Store(id="version", data=0),
            dcc.Interval(id="tick", interval=self.interval_ms),
            html.Div([html.Div(id="topbar", className="topbar-items"),
                      html.Span(dcc.Checklist(id="live", options=[{"label": " auto-refresh", "value": "on"}],
                                              value=["on"], inline=True), className="live")],
                     className="topbar"),
            html.Div(id="page", className="page"),
        ])

    def topbar(self, p: dict) -> list:
        view = p.get("view") or ("overview" if p.get("run") else "runs")
        items = [html.Span("fp8scope", className="brand")]
        for key, label in VIEWS:
            params = {"view": key, "run": p.get("run"), "b": p.get("b")}
            if key == "runs":
                params = {"view": "runs"}
            a = link(label, **params)
            a.className = "active" if key == view else None
            a.id = f"nav-{key}"
            items.append(a)
        if p.get("run"):
            items.append(html.Span(p["run"], className="runname", id="nav-run"))
        return items

    # -- callbacks ------------------------------------------------------------------------
    def _callbacks(self):
        app = self.app

        @app.callback(Output("page", "children"), Output("topbar", "children"),
                      Input("url", "search"), Input("version", "data"))
        def render(search, _version):
            p = parse(search)
            return self.render(p), self.topbar(p)

        @app.callback(Output("version", "data"), Input("tick", "n_intervals"),
                      State("url", "search"), State("live", "value"), State("version", "data"),
                      prevent_initial_call=True)
        def tick(n, search, live, version):
            if not live:
                return no_update
            p = parse(search)
            view = p.get("view") or ("overview" if p.get("run") else "runs")
            if view == "runs":
                return (version or 0) + 1 if (n or 0) % 3 == 0 else no_update
            changed = False
            for name in {p.get("run"), p.get("b") if view == "compare" else None} - {None}:
                try:
                    changed |= self.cache.refresh(self.root.resolve(name))
                except Exception:  # noqa: BLE001 - the page shows the error; the tick stays quiet
                    continue
            return (version or 0) + 1 if changed else no_update

        @app.callback(Output("url", "search", allow_duplicate=True),
                      Input({"type": "ctl", "name": ALL}, "value"),
                      State({"type": "ctl", "name": ALL}, "id"), State("url", "search"),
                      prevent_initial_call=True)
        def controls(values, ids, search):
            if not ctx.triggered_id:
                return no_update
            p = parse(search)
            for i, v in zip(ids, values):
                p[i["name"]] = v if v not in (None, [], "") else None
            new = "?" + urlencode({k: v for k, v in p.items() if v})
            return new if new != (search or "") else no_update

        @app.callback(Output("url", "search", allow_duplicate=True),
                      Input("heatmap-graph", "clickData"), State("url", "search"), prevent_initial_call=True)
        def heatmap_click(click, search):
            if not click or not click.get("points"):
                return no_update
            p = parse(search)
            label = click["points"][0].get("y")
            try:
                e = self.cache.get(self.root.resolve(p.get("run")))
            except Exception:  # noqa: BLE001
                return no_update
            layer = next((l for l in D.layer_order(e)["layer"] if plot_label(l) == label), None)
            if layer is None:
                return no_update
            return "?" + urlencode({k: v for k, v in {"view": "tensor", "run": p.get("run"), "layer": layer,
                                                      "role": p.get("role")}.items() if v})

    # -- pages ----------------------------------------------------------------------------
    def render(self, p: dict):
        view = p.get("view") or ("overview" if p.get("run") else "runs")
        if view == "runs":
            return panel(self.page_runs, p)
        if not p.get("run"):
            return note("Pick a run on the Runs page first.")
        try:
            path = self.root.resolve(p["run"])
        except PathRejected as e:
            return error_card("Refused", f"{e}. Only run folders under the runs root are served.")
        try:
            e = self.cache.get(path)
        except Fp8ScopeError as exc:
            return error_card("This run could not be read", str(exc).splitlines()[0])
        except Exception as exc:  # noqa: BLE001
            return error_card("This run could not be read", f"{type(exc).__name__}: {exc}")
        page = {"overview": self.page_overview, "heatmap": self.page_heatmap, "outliers": self.page_outliers,
                "tensor": self.page_tensor, "compare": self.page_compare, "live": self.page_live}.get(view)
        if page is None:
            return note(f"unknown view {view!r}")
        return panel(page, e, p)

    # Runs -------------------------------------------------------------------------------
    def page_runs(self, p):
        names = self.root.list_runs()
        if not names:
            return note(f"No runs under {self.root.root} yet. Point a Monitor at a folder inside it.")
        rows = []
        for n in names:
            path = self.root.root / n
            s = D.run_status(path, self.cache)
            if s["events"] is None:
                ev = "no detection yet"
            else:
                ev = ", ".join(f"{s['events'].get(k, 0)} {k}" for k in D.SEVERITIES if s["events"].get(k)) or "none"
            status = html.Span(s["status"], className=f"status status-{s['status']}")
            if s["status"] == "error":
                rows.append([html.Span(n), status, html.Span(s["error"], className="muted"), "", "", "", ""])
                continue
            rows.append([link(n, view="overview", run=n), status, fmt(s["last_step"], "d") if s["last_step"] is not None else "-",
                         ago(s["last_write"]), human(s["size"]), ev, s["created"] or "-"])
        tbl = table(["run", "status", "last step", "last write", "size", "events", "created"], rows, {2, 4},
                    id="runs-table")
        opts = [{"label": n, "value": n} for n in names]
        pick = html.Div([
            html.H4("Open or compare"),
            html.Div([ctl("run", dcc.Dropdown, "run A", options=opts, value=p.get("run"), style={"width": "320px"}),
                      ctl("b", dcc.Dropdown, "run B (optional)", options=opts, value=p.get("b"), style={"width": "320px"}),
                      html.Div([link("open A", view="overview", run=p.get("run")) if p.get("run") else html.Span(""),
                                html.Span("  "),
                                link("compare A and B", view="compare", run=p.get("run"), b=p.get("b"))
                                if p.get("run") and p.get("b") else html.Span("")])],
                     className="controls"),
        ], className="card")
        return [html.H3(f"Runs under {self.root.root}"),
                html.Div("live: written to in the last 2 minutes and streams still open; finished: every stream "
                         "closed cleanly; crashed: streams not closed and nothing written for 2 minutes.",
                         className="muted"),
                tbl, pick]

    # Overview ---------------------------------------------------------------------------
    def banner(self, e):
        level, text = D.verdict(e)
        title = {"ok": "No problems flagged", "warning": "Warnings", "critical": "Unstable",
                 "unknown": "Not analysed yet"}[level]
        return html.Div([html.Span(title + ": "), html.Span(text)], className=f"banner banner-{level}", id="verdict")

    def page_overview(self, e, p):
        F = _figures()
        ev = D.events(e)
        parts = [panel(self.banner, e)]
        parts.append(panel(self.run_facts, e))
        names = [n for n in ("loss", "grad_norm") if n in D.scalar_names(e)]
        if names:
            fr = D.scalars_frame(e, names)
            fig = F.scalars_with_events(fr, self._plot_events(ev), title="loss and grad norm")
            parts.append(graph(fig, id="overview-scalars"))
        else:
            parts.append(note("No loss or grad_norm scalars logged in this run."))
        sl = D.shadow_loss_frame(e)
        if sl is None:
            parts.append(note("No BF16 shadow in this run (no shadow_compare / shadow_fork table): "
                              "FP8 vs BF16 loss is not available."))
        elif sl.empty:
            parts.append(note("shadow_loss table has no numeric columns to plot."))
        else:
            fr = D.scalars_frame(e, ["loss"]) if "loss" in D.scalar_names(e) else None
            import plotly.graph_objects as go

            fig = go.Figure()
            if fr is not None and len(fr):
                fig.add_trace(go.Scatter(x=fr["step"], y=fr["value"], mode="lines", name="training loss (fp8)",
                                         line={"color": "#bbb"}))
            for name, g in sl.groupby("name", sort=False):
                fig.add_trace(go.Scatter(x=g["step"], y=g["value"], mode="lines+markers", name=plot_label(name),
                                         marker={"size": 4}))
            fig.update_layout(title="FP8 vs BF16 shadow loss", height=300, margin={"l": 10, "r": 10, "t": 40, "b": 40})
            parts.append(graph(fig, id="overview-shadow"))
        fv = D.fork_verdicts(e)
        if fv is not None and not fv.empty:
            parts.append(html.H4("Shadow forks (FP8 vs BF16 from the same state)"))
            parts.append(table(["fork", "from step", "last step", "verdict", "reason", "trigger"],
                               [[int(r["fork_id"]), int(r["start_step"]), int(r["last_step"]), r["verdict"],
                                 r["reason"] or "", r["trigger"] or ""] for _, r in fv.iterrows()], {0, 1, 2},
                               id="forks-table"))
        parts.append(panel(self.events_panel, e, ev))
        return parts

    def run_facts(self, e):
        info = e.cached(("info",), e.run.info)
        rec = e.run.manifest.get("recipe") or {}
        txt = (f"{info['steps']} steps (last {info['last_step']}), {info['tensors']} tensors, "
               f"ranks {info['ranks']}, {human(info['size_bytes'])}, last write {ago(info['last_write'])}; recipe: "
               + (", ".join(f"{k}={v}" for k, v in rec.items()) or "-"))
        return html.Div(txt, className="muted", id="run-facts")

    @staticmethod
    def _plot_events(ev):
        if ev is None or ev.empty:
            return ev
        ev = ev.copy()
        for c in ("rule", "layer", "tensor", "message"):
            if c in ev:
                ev[c] = ev[c].map(lambda s: plot_label(s) if isinstance(s, str) else s)
        return ev

    def events_panel(self, e, ev, layer=None, role=None, limit=200):
        if ev is None:
            return note("No events table in this run: detection has not run on it yet (fp8scope events), "
                        "so there is no event timeline.")
        if layer is not None:
            ev = ev[(ev["layer"] == layer) & (ev["tensor"].isna() | (ev["tensor"] == role))]
        if ev.empty:
            return note("No events" + (" on this tensor." if layer else " in this run: detectors flagged nothing."))
        import plotly.graph_objects as go

        pe = self._plot_events(ev)
        fig = go.Figure()
        for sev in D.SEVERITIES:
            g = pe[pe["severity"] == sev]
            if len(g):
                fig.add_trace(go.Scatter(x=g["step"], y=g["rule"], mode="markers", name=sev,
                                         marker={"color": _figures().SEVERITY_COLORS.get(sev), "size": 9},
                                         text=g["layer"].fillna("") + " " + g["tensor"].fillna(""),
                                         hovertemplate="step %{x}<br>%{y}<br>%{text}<extra></extra>"))
        fig.update_layout(title="event timeline", height=260, xaxis_title="step",
                          margin={"l": 10, "r": 10, "t": 40, "b": 40})
        shown = ev.sort_values(["step"]).head(limit)
        rows = []
        for _, r in shown.iterrows():
            lay = r.get("layer")
            lay_cell = (link(lay, view="tensor", run=self.root.name_of(e.path), layer=lay, role=r.get("tensor"))
                        if isinstance(lay, str) and lay else "-")
            rows.append([int(r["step"]), int(r["rank"]), r["severity"], r["rule"], lay_cell,
                         r.get("tensor") if isinstance(r.get("tensor"), str) else "-",
                         fmt(r.get("value")), fmt(r.get("threshold")), r.get("message") or ""])
        return [graph(fig, id="event-timeline"),
                html.Div(f"{len(ev)} events" + (f" (first {limit} shown)" if len(ev) > limit else ""), className="muted"),
                table(["step", "rank", "severity", "rule", "layer", "tensor", "value", "threshold", "message"], rows,
                      {0, 1, 6, 7}, id="events-table")]

    # Heatmap ----------------------------------------------------------------------------
    def _stat_options(self, e):
        return [{"label": D.STATS[k][0], "value": k} for k in D.STATS
                if D.STATS[k][3] == "tensors" or e.has(D.STATS[k][3])]

    def heatmap_figure(self, e, stat, role, agg, layer_re, title=None, last_steps=None, zrange=None):
        # the figure itself is cached per run version: a warm view switch skips pivot + plotly validation
        return e.cached(("heatmap_fig", stat, role, agg, layer_re, title, last_steps, zrange),
                        lambda: self._heatmap_figure(e, stat, role, agg, layer_re, title, last_steps, zrange))

    def _heatmap_figure(self, e, stat, role, agg, layer_re, title=None, last_steps=None, zrange=None):
        F = _figures()
        fr = D.heatmap_frame(e, stat, role, agg, layer_re, last_steps=last_steps)
        if fr.empty:
            raise D.NoData(f"no {D.STATS[stat][0]} values for role {role!r}"
                           + (" (cheap-stats steps carry only amax and scales)" if "pct" in stat else ""))
        fr = fr.assign(layer=fr["layer"].map(plot_label))
        ev = D.flagged(e, role if D.STATS[stat][3] == "tensors" else None)
        marks = []
        if ev is not None and not ev.empty:
            marks.append(self._plot_events(ev)[["layer", "step", "severity", "rule"]])
        nf = D.nonfinite_cells(e, role) if D.STATS[stat][3] == "tensors" else pd.DataFrame()
        if len(nf):
            marks.append(nf.assign(layer=nf["layer"].map(plot_label), severity="critical", rule="non-finite"))
        flagged = pd.concat(marks, ignore_index=True) if marks else None
        if flagged is not None and last_steps:
            flagged = flagged[flagged["step"] >= fr["step"].min()]
        fig = F.heatmap(fr, stat=D.STATS[stat][0].split(",")[0].split("(")[0].strip(), flagged=flagged, title=title)
        colors = {"headroom": "RdBu", "sqnr_db": "Viridis"}
        if stat in colors:
            fig.update_traces(colorscale=colors[stat], selector={"type": "heatmap"})
        if stat == "headroom" and not zrange and len(fr):
            # overflow (< 0) is the news: keep the full negative side, cap the (uninformative) large headroom
            v = fr["value"].astype(float)
            zrange = (min(-1.0, float(v.min())), max(1.0, float(v.quantile(0.95))))
        if zrange:
            fig.update_traces(zmin=zrange[0], zmax=zrange[1], selector={"type": "heatmap"})
            if stat == "headroom" and zrange[0] < 0 < zrange[1]:
                fig.update_traces(zmid=0, selector={"type": "heatmap"})
        fig.update_layout(uirevision=f"{stat}-{role}")
        n_layers = fr["layer"].nunique()
        return fig, fr, ev, n_layers

    def page_heatmap(self, e, p):
        rl = D.roles(e)
        if not rl:
            raise D.NoData("No tensors table in this run yet: nothing to draw.")
        stat = p.get("stat") if p.get("stat") in D.STATS else "headroom"
        role = p.get("role") if p.get("role") in rl else ("activation" if "activation" in rl else rl[0])
        agg = p.get("agg") if p.get("agg") in ("worst", "mean") else "worst"
        controls = html.Div([
            ctl("stat", dcc.Dropdown, "statistic", options=self._stat_options(e), value=stat, clearable=False,
                style={"width": "420px"}),
            ctl("role", dcc.Dropdown, "tensor role", options=[{"label": r, "value": r} for r in rl], value=role,
                clearable=False),
            ctl("agg", dcc.RadioItems, "per step bucket", options=[{"label": " worst ", "value": "worst"},
                                                                   {"label": " mean", "value": "mean"}],
                value=agg, inline=True),
            ctl("q", dcc.Input, "layer filter (regex)", value=p.get("q") or "", debounce=True, type="text"),
        ], className="controls")
        body = panel(self._heatmap_body, e, stat, role, agg, p.get("q") or None)
        return [controls, body]

    def _heatmap_body(self, e, stat, role, agg, q):
        fig, fr, ev, n_layers = self.heatmap_figure(e, stat, role, agg, q)
        b = D.heatmap_width(e, D.STATS[stat][3])
        msg = (f"{n_layers} layers x {fr['step'].nunique()} columns; each column covers {b} step(s), colour = "
               f"{'worst' if agg == 'worst' else 'mean'} value in it. x = flagged cell (events, non-finite). "
               "Click a cell to open that tensor.")
        if stat.startswith("shadow"):
            msg += " Shadow error is per layer (role does not apply)."
        evnote = (note("No events table in this run: flagged cells show only non-finite values.") if ev is None
                  else html.Span())
        return [html.Div(msg, className="muted"), evnote, graph(fig, id="heatmap-graph")]

    # Outliers ---------------------------------------------------------------------------
    def page_outliers(self, e, p):
        rl = D.roles(e)
        role = p.get("role") if p.get("role") in rl else None
        controls = html.Div([ctl("role", dcc.Dropdown, "tensor role (empty = all)",
                                 options=[{"label": r, "value": r} for r in rl], value=role)], className="controls")
        return [controls, html.Div(D.SCORE_DOC, className="muted"), panel(self._outlier_table, e, role)]

    def _outlier_table(self, e, role):
        df = D.outliers(e, role)
        run = self.root.name_of(e.path)
        rows = []
        for i, r in df.head(100).iterrows():
            rows.append([i + 1, link(r["layer"], view="tensor", run=run, layer=r["layer"], role=r["tensor"]),
                         r["tensor"], fmt(r["score"], ".2f"), fmt(r["spike"], ".2f"), fmt(r["overflow_binades"], ".2f"),
                         fmt(r["min_headroom"], ".2f"), fmt(r["underflow_pct"], ".2f"), fmt(r["overflow_pct"], ".2f"),
                         fmt(r["saturated_pct"], ".2f"), int(r["nonfinite"]), f"{int(r['critical'])}/{int(r['warning'])}",
                         fmt(r["max_amax"]), fmt(r["worst_step"], ".0f")])
        cols = ["#", "layer", "role", "score", "spike (binades)", "overflow (binades)", "min headroom",
                "max underflow %", "max overflow %", "max saturation %", "non-finite", "events crit/warn",
                "max amax", "step of max amax"]
        extra = [] if D.events(e) is not None else [note("No events table: event terms of the score are 0.")]
        return extra + [table(cols, rows, set(range(3, 14)) | {0}, id="outliers-table")]

    # Tensor -----------------------------------------------------------------------------
    def page_tensor(self, e, p):
        order = D.layer_order(e)
        if order.empty:
            raise D.NoData("No tensors table in this run yet.")
        layers = list(order["layer"])
        rl = D.roles(e)
        layer = p.get("layer") if p.get("layer") in layers else None
        role = p.get("role") if p.get("role") in rl else (rl[0] if rl else None)
        if layer is None:
            top = D.outliers(e, None)
            layer, role = (top["layer"].iloc[0], top["tensor"].iloc[0]) if len(top) else (layers[0], role)
        controls = html.Div([
            ctl("layer", dcc.Dropdown, "layer", options=[{"label": l, "value": l} for l in layers], value=layer,
                clearable=False, style={"width": "420px"}),
            ctl("role", dcc.Dropdown, "tensor role", options=[{"label": r, "value": r} for r in rl], value=role,
                clearable=False),
        ], className="controls")
        return [controls, html.H3(f"{layer} / {role}", id="tensor-title"), panel(self._tensor_body, e, layer, role)]

    def _tensor_body(self, e, layer, role):
        import plotly.graph_objects as go

        F = _figures()
        s = D.tensor_series(e, layer, role)
        if s.empty:
            raise D.NoData(f"No rows for {layer} / {role} in this run.")
        ev = D.events(e)
        ev_t = None
        if ev is not None and not ev.empty:
            ev_t = ev[(ev["layer"] == layer) & (ev["tensor"].isna() | (ev["tensor"] == role))]
        fig = F.amax_vs_range(s, plot_label(layer), role, events=self._plot_events(ev_t),
                              title="amax vs representable range fp8_max * scale_inv")
        fig.add_trace(go.Scatter(x=s["step"], y=s["expected_amax"], mode="lines", name="expected amax (recipe)",
                                 line={"dash": "dot"}))
        fig.update_layout(height=360, showlegend=True)
        f2 = go.Figure(go.Scatter(x=s["step"], y=s["scale_inv"], mode="lines", name="scale_inv"))
        f2.update_layout(title="scale_inv (rising = scale collapsing)", yaxis_type="log", height=260,
                         margin={"l": 10, "r": 10, "t": 40, "b": 40})
        f3 = go.Figure()
        for c, n in (("overflow_pct", "overflow %"), ("underflow_pct", "underflow %"), ("saturated_pct", "saturation %")):
            d = s[s[c].notna()]
            f3.add_trace(go.Scatter(x=d["step"], y=d[c], mode="lines+markers", name=n, marker={"size": 4}))
        f3.update_layout(title="overflow / underflow / saturation % (full-stats steps)", height=280,
                         margin={"l": 10, "r": 10, "t": 40, "b": 40})
        meta = (f"format {s['fp8_format'].iloc[-1]}, source {s['source'].iloc[-1]}; {len(s)} points "
                f"(steps bucketed, worst value per bucket)")
        return [html.Div(meta, className="muted"), graph(fig, id="tensor-amax"),
                html.Div([html.Div(graph(f2, id="tensor-scale")), html.Div(graph(f3, id="tensor-pct"))], className="row2"),
                html.H4("Events on this tensor"), panel(self.events_panel, e, ev, layer=layer, role=role)]

    # Compare ----------------------------------------------------------------------------
    def page_compare(self, e, p):
        import plotly.graph_objects as go

        names = self.root.list_runs()
        b_name = p.get("b")
        stat = p.get("stat") if p.get("stat") in D.STATS else "headroom"
        rl = D.roles(e)
        role = p.get("role") if p.get("role") in rl else ("activation" if "activation" in rl else (rl[0] if rl else None))
        controls = html.Div([
            ctl("b", dcc.Dropdown, "compare with", options=[{"label": n, "value": n} for n in names if n != p["run"]],
                value=b_name if b_name in names else None, style={"width": "320px"}),
            ctl("stat", dcc.Dropdown, "statistic", options=self._stat_options(e), value=stat, clearable=False,
                style={"width": "380px"}),
            ctl("role", dcc.Dropdown, "tensor role", options=[{"label": r, "value": r} for r in rl], value=role,
                clearable=False),
        ], className="controls")
        if not b_name:
            return [controls, note("Pick a second run to compare with.")]
        try:
            e2 = self.cache.get(self.root.resolve(b_name))
        except PathRejected as exc:
            return [controls, error_card("Refused", str(exc))]
        except Fp8ScopeError as exc:
            return [controls, error_card("Run B could not be read", str(exc).splitlines()[0])]

        def loss_fig():
            fig = go.Figure()
            for ent, nm in ((e, p["run"]), (e2, b_name)):
                for sc in ("loss", "grad_norm"):
                    fr = D.scalars_frame(ent, [sc])
                    if len(fr):
                        fig.add_trace(go.Scatter(x=fr["step"], y=fr["value"], mode="lines",
                                                 name=plot_label(f"{nm}: {sc}"), yaxis="y" if sc == "loss" else "y2"))
            if not fig.data:
                raise D.NoData("Neither run logged loss or grad_norm.")
            fig.update_layout(title="loss (left) and grad norm (right), aligned by step", height=320,
                              yaxis={"title": "loss"}, yaxis2={"title": "grad norm", "overlaying": "y", "side": "right",
                                                               "type": "log"},
                              margin={"l": 10, "r": 10, "t": 40, "b": 40})
            return graph(fig, id="compare-loss")

        def side(ent, nm, zr):
            fig, *_ = self.heatmap_figure(ent, stat, role, "worst", None, title=plot_label(nm), zrange=zr)
            return graph(fig, id=f"compare-heat-{'a' if ent is e else 'b'}")

        def zrange():
            vals = []
            for ent in (e, e2):
                try:
                    vals.append(D.heatmap_frame(ent, stat, role)["value"])
                except D.NoData:
                    pass
            v = pd.concat(vals) if vals else pd.Series(dtype=float)
            return (float(v.min()), float(v.max())) if len(v) else None

        zr = panel(zrange)
        zr = zr if isinstance(zr, tuple) else None
        return [controls, panel(loss_fig),
                html.Div("Heatmaps share one colour scale; x is the step in each run.", className="muted"),
                html.Div([html.Div(panel(side, e, p["run"], zr)), html.Div(panel(side, e2, b_name, zr))],
                         className="row2")]

    # Live -------------------------------------------------------------------------------
    def page_live(self, e, p):
        F = _figures()
        st = D.run_status(e.path, self.cache)
        last = D._last_step_sql(e)
        head = html.Div([html.Span(st["status"], className=f"status status-{st['status']}"),
                         html.Span(f"  last step ", className="muted"), html.B(str(last), id="live-last-step"),
                         html.Span(f"  · last write {ago(st['last_write'])} · refreshed {time.strftime('%H:%M:%S')} "
                                   f"(reads only bytes appended since the last refresh; a torn tail is retried)",
                                   className="muted")], className="card")
        parts = [head, panel(self.banner, e)]
        names = [n for n in ("loss", "grad_norm") if n in D.scalar_names(e)]
        if names:
            parts.append(graph(F.scalars_with_events(D.scalars_frame(e, names, last_steps=500),
                                                     self._plot_events(D.events(e)), title="last 500 steps"),
                               id="live-scalars"))
        rl = D.roles(e)
        if rl:
            role = "activation" if "activation" in rl else rl[0]
            parts.append(panel(lambda: graph(self.heatmap_figure(e, "headroom", role, "worst", None,
                                                                 title=f"amax headroom, {role}, last 300 steps",
                                                                 last_steps=300)[0], id="live-heatmap")))
        ev = D.events(e)
        if ev is not None and not ev.empty:
            parts.append(panel(self.events_panel, e, ev.tail(20)))
        elif ev is None:
            parts.append(note("No events table in this run yet."))
        return parts


def parse(search: str | None) -> dict:
    q = parse_qs((search or "").lstrip("?"), keep_blank_values=False)
    return {k: q[k][0] for k in PARAMS if k in q and q[k]}


def create_app(root: str | Path, interval_ms: int = 2000) -> Dash:
    return DashboardApp(root, interval_ms).app
