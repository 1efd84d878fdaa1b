"""The Dash app: URL-driven views over the runs under one root.

All state lives in the URL query (``?run=NAME&view=heatmap&stat=headroom&role=activation``), so every
view is a link that can be shared or reloaded. When the URL changes, one callback draws the page: its
controls and its body. A ``dcc.Interval`` refreshes the runs named in the URL (reading only new bytes)
and watches their analysis; when, and only when, the data or the analysis changed since the body was
drawn, it redraws the *body* alone. Controls are never redrawn by a refresh, so an open dropdown stays open and
a half-typed filter stays typed.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from dash import ALL, Dash, Input, Output, State, ctx, dcc, html, no_update

from dashboard import pages as P
from dashboard import queries as Q
from dashboard.paths import PathRejected, RunsRoot
from dashboard.runcache import RunCache
from dashboard.verdict import ensure
from dashboard.ui import error_card, link, note, panel, plot_label
from fp8scope.errors import Fp8ScopeError

VIEWS = [("runs", "Runs"), ("overview", "Overview"), ("heatmap", "Heatmap"), ("outliers", "Outlier layers"),
         ("tensor", "Tensor"), ("recipes", "Recipes"), ("compare", "Compare"), ("live", "Live")]
PARAMS = ("view", "run", "b", "stat", "role", "agg", "layer", "q", "s0", "s1", "page", "info")
# view -> (controls, body); controls None: the page has none
PAGES = {"overview": (None, P.overview_body), "heatmap": (P.heatmap_controls, P.heatmap_body),
         "outliers": (P.outliers_controls, P.outliers_body), "tensor": (P.tensor_controls, P.tensor_body),
         "recipes": (P.recipes_controls, P.recipes_body), "compare": (P.compare_controls, P.compare_body),
         "live": (None, P.live_body)}
ZOOMABLE = ("heatmap-graph", "tensor-amax")


def view_of(p: dict) -> str:
    return p.get("view") or ("overview" if p.get("run") else "runs")


class DashboardApp:
    def __init__(self, root: str | Path, interval_ms: int = 1500):
        self.root = RunsRoot(root)
        self.cache = RunCache(warm=Q.warm_up)
        self.interval_ms = interval_ms
        self.app = Dash(__name__, title="fp8scope", suppress_callback_exceptions=True,
                        assets_folder=str(Path(__file__).parent / "assets"), update_title=None)
        self.app.layout = self.layout
        self._callbacks()

    # -- layout ---------------------------------------------------------------------------
    def layout(self):
        return html.Div([
            dcc.Location(id="url", refresh=False),
            dcc.Store(id="shown", data=""),
            dcc.Interval(id="tick", interval=self.interval_ms),
            html.Div([html.Div(id="topbar", className="topbar-items"),
                      html.Span(dcc.Checklist(id="live", options=[{"label": " auto-refresh", "value": "on"}],
                                              value=["on"], inline=True), className="live")],
                     className="topbar"),
            # a spinner while a page is drawn (cold loads); live refreshes redraw the body only, without one
            dcc.Loading(html.Div(id="page", className="page"), target_components={"page": "children"},
                        delay_show=300, type="circle"),
            html.Div(id="prefetch", style={"display": "none"}),
        ])

    def topbar(self, p: dict) -> list:
        view = view_of(p)
        items = [html.Span("fp8scope", className="brand")]
        for key, label in VIEWS:
            params = {"view": "runs"} if key == "runs" else {"view": key, "run": p.get("run"), "b": p.get("b")}
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

        @app.callback(Output("prefetch", "children"), Input("tick", "n_intervals"), prevent_initial_call=True)
        def prefetch(n):
            """After the first page is drawn, an empty hidden figure: Chromium fetches and parses plotly.js
            while the user reads, not after the click that opens a run."""
            if n != 1:
                return no_update
            return dcc.Graph(figure={"data": [], "layout": {}}, config={"staticPlot": True})

        # "shown" holds the signature of the data the body was drawn from, taken *before* drawing it: a
        # change that lands while a page is drawn differs from it, so the next tick redraws the body
        @app.callback(Output("page", "children"), Output("topbar", "children"), Output("shown", "data"),
                      Input("url", "search"), State("tick", "n_intervals"))
        def render(search, n):
            p = parse(search)
            sig = self.signature(p, n or 0)
            return self.render(p), self.topbar(p), sig

        @app.callback(Output("body", "children"), Output("shown", "data", allow_duplicate=True),
                      Input("tick", "n_intervals"), State("url", "search"), State("live", "value"),
                      State("shown", "data"), prevent_initial_call=True)
        def tick(n, search, live, shown):
            if not live:
                return no_update, no_update
            p = parse(search)
            sig = self.signature(p, n or 0)
            if sig == shown:
                return no_update, no_update
            return self.body(p), sig

        @app.callback(Output("url", "search", allow_duplicate=True),
                      Input({"type": "ctl", "name": ALL}, "value"),
                      State({"type": "ctl", "name": ALL}, "id"), State("url", "search"),
                      prevent_initial_call=True)
        def controls(values, ids, search):
            if not ctx.triggered_id:
                return no_update
            p = parse(search)
            p["view"] = view_of(p)  # picking run A on the Runs page stays on the Runs page
            for i, v in zip(ids, values):
                p[i["name"]] = None if v in (None, [], "") else str(v)
            p.pop("page", None)  # a new filter starts at the first page of events
            return moved_to(p, search)

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
            layer = next((l for l in Q.layer_order(e)["layer"] if plot_label(l) == label), None)
            if layer is None:
                return no_update
            return search_of({"view": "tensor", "run": p.get("run"), "layer": layer, "role": p.get("role")})

        for tid in ("outliers-table", "events-table"):
            @app.callback(Output("url", "search", allow_duplicate=True), Input(tid, "active_cell"),
                          State(tid, "derived_viewport_data"), State("url", "search"), prevent_initial_call=True)
            def open_row(cell, rows, search):
                """A click on a row of the outliers or events table opens that row's tensor."""
                if not cell or not rows or cell.get("row") is None or cell["row"] >= len(rows):
                    return no_update
                r = rows[cell["row"]]
                layer, role = r.get("layer"), r.get("role", r.get("tensor"))
                if not layer or layer == "-":
                    return no_update
                return search_of({"view": "tensor", "run": parse(search).get("run"), "layer": layer,
                                  "role": role if role != "-" else None})

        for gid in ZOOMABLE:
            @app.callback(Output("url", "search", allow_duplicate=True), Input(gid, "relayoutData"),
                          State("url", "search"), prevent_initial_call=True)
            def zoom(relayout, search):
                """Zoom re-buckets on the server: the x range becomes the URL's step range."""
                r = relayout or {}
                p = parse(search)
                ax = next((k.split(".")[0] for k in r if re.fullmatch(r"xaxis\d*\.range\[0\]", k)), None)
                if any(re.fullmatch(r"xaxis\d*\.autorange", k) and v for k, v in r.items()):
                    p.pop("s0", None), p.pop("s1", None)
                elif ax is not None and f"{ax}.range[1]" in r:  # any subplot's x axis (they share one)
                    p["s0"], p["s1"] = str(int(float(r[f"{ax}.range[0]"]))), str(int(round(float(r[f"{ax}.range[1]"]))))
                else:
                    return no_update
                return moved_to(p, search)

    def signature(self, p: dict, n: int) -> str:
        """What the body shows depends on: the run(s)' versions and their analysis state."""
        view = view_of(p)
        if view == "runs":
            return str(n // 3)  # the Runs list: every third tick
        parts = []
        for name in [p.get("run"), p.get("b") if view == "compare" else None]:
            if not name:
                continue
            try:
                path = self.root.resolve(name)
                self.cache.refresh(path)
                e = self.cache.get(path)
                st = ensure(e, self.cache)
                parts.append(f"{e.version}/{st['generation']}")
            except Exception:  # noqa: BLE001 - the page shows the error; the tick stays quiet
                parts.append("error")
        return "|".join(parts)

    # -- pages ----------------------------------------------------------------------------
    def entry(self, p: dict):
        """(entry, None) for the URL's run, or (None, a card saying why not)."""
        if not p.get("run"):
            return None, note("Pick a run on the Runs page first.")
        try:
            path = self.root.resolve(p["run"])
        except PathRejected as e:
            return None, error_card("Refused", f"{e}. Only run folders under the runs root are served.")
        try:
            return self.cache.get(path), None
        except Fp8ScopeError as exc:
            return None, error_card("This run could not be read", str(exc).splitlines()[0])
        except Exception as exc:  # noqa: BLE001
            return None, error_card("This run could not be read", f"{type(exc).__name__}: {exc}")

    def render(self, p: dict):
        view = view_of(p)
        if view == "runs":
            return [panel(P.runs_controls, self, p), html.Div(self.body(p), id="body")]
        if view not in PAGES:
            return note(f"unknown view {view!r}")
        e, problem = self.entry(p)
        if problem is not None:
            return problem
        controls = PAGES[view][0]
        return [panel(controls, self, e, p) if controls else html.Div(), html.Div(self.body(p), id="body")]

    def body(self, p: dict):
        view = view_of(p)
        if view == "runs":
            return panel(P.runs_body, self, p)
        if view not in PAGES:
            return note(f"unknown view {view!r}")
        e, problem = self.entry(p)
        return problem if problem is not None else panel(PAGES[view][1], self, e, p)


def search_of(p: dict) -> str:
    """The URL query of ``p``, empty values left out."""
    return "?" + urlencode({k: v for k, v in p.items() if v})


def moved_to(p: dict, search: str | None):
    """The new URL query for ``p``, or no_update when it is the current one."""
    new = search_of(p)
    return new if new != (search or "") else no_update


def parse(search: str | None) -> dict:
    q = parse_qs((search or "").lstrip("?"), keep_blank_values=False)
    return {k: q[k][0] for k in PARAMS if k in q and q[k]}


def create_app(root: str | Path, interval_ms: int = 1500) -> Dash:
    return DashboardApp(root, interval_ms).app
