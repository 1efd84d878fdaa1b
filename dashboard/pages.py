"""The dashboard's pages. Each page is a pair: ``controls(app, e, p)`` (drawn when the URL changes, never
on a live refresh, so an open dropdown stays open) and ``body(app, e, p)`` (figures and tables, redrawn
when the run or its analysis changes). ``p`` is the URL query as a dict.

The verdict, first anomaly, culprit, NaN origin, forks, FP8-vs-BF16 ranking, advice and the events
are the report's (:mod:`dashboard.verdict`); the outlier ranking is the ``layer_outlier`` rule's
(:mod:`dashboard.outliers`); the statistics are :mod:`fp8scope.derived`'s.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from dash import dcc, html

from dashboard import queries as Q
from dashboard import verdict as V
from dashboard.outliers import outliers, score_doc
from dashboard.rollup import NoData
from dashboard.runstatus import _last_step_sql, run_status
from dashboard.ui import (RUN_COLORS, ago, ctl, data_table, error_card, fmt, graph, human, link, log_axis, note,
                          panel, plot_label, table)
from fp8scope.detect.report import BLAME_TITLES, culprit_text
from fp8scope.detect.rules import SEVERITY_RANK

EVENTS_PAGE = 25
PRELOAD_RUNS = 2  # the Runs list opens its most recently written runs in the background
HEADROOM_RANGE = (-4.0, 12.0)  # binades: one fixed, shared scale, so a colour means the same on every run
# overflow (< 0) red, 0..4 binades neutral (normal headroom), then a second hue for wasted range (a stale scale)
HEADROOM_SCALE = [[0.0, "#67001f"], [0.2, "#d6604d"], [0.2499, "#fbd0c0"], [0.25, "#f7f7f7"], [0.5, "#e6e6e6"],
                  [0.75, "#6baed6"], [1.0, "#08306b"]]


def figures():
    import fp8scope.figures as F  # shared with the HTML report

    return F


def span_of(p: dict) -> tuple[int, int] | None:
    def num(k):
        try:
            return int(float(p[k])) if p.get(k) not in (None, "") else None
        except (TypeError, ValueError):
            return None

    lo, hi = num("s0"), num("s1")
    return None if lo is None and hi is None else (lo, hi)


def plot_events(ev: pd.DataFrame | None) -> pd.DataFrame | None:
    if ev is None or ev.empty:
        return ev
    ev = ev.copy()
    for c in ("rule", "layer", "tensor", "message"):
        if c in ev:
            ev[c] = ev[c].map(lambda s: plot_label(s) if isinstance(s, str) else s)
    return ev


# ---- the verdict card ----------------------------------------------------------------------
def card(app, e, p=None):
    st = V.ensure(e, app.cache)
    res = st["result"]
    run = app.root.name_of(e.path)
    if res is None:
        if st["error"]:
            return html.Div([html.Div("Not analysed: the analysis failed", className="banner banner-unknown", id="verdict"),
                             error_card("Analysis failed", st["error"])], className="card")
        return html.Div([
            html.Div("Analysing this run (the same analysis as fp8scope report)...", className="banner banner-unknown",
                     id="verdict"),
            html.Div([html.Progress(value=f"{st['progress']:.2f}", max="1", id="analysis-progress"),
                      html.Span(f"  {st['phase']}", className="muted")]),
        ], className="card", id="card")
    rep = res["report"]
    b = rep["blame"]
    sev = rep["events"]["by_severity"]
    css = "critical" if sev.get("critical") else "warning" if sev.get("warning") else (
        "ok" if b["level"] == "clean" else "unknown")
    rows = [html.Div([html.B(BLAME_TITLES[b["level"]] + ": "), html.Span(b["why"])], id="verdict",
                     className=f"banner banner-{css}")]
    c = rep.get("culprit")
    if c:
        rows.append(html.Div([html.Span("Culprit: ", className="k"),
                              link(f"{c['layer']} {c['tensor']}", view="tensor", run=run, layer=c["layer"], role=c["tensor"]),
                              html.Span(f" at step {c['step']} ({c['rule']})")], id="card-culprit"))
    else:
        rows.append(html.Div([html.Span("Culprit: ", className="k"), html.Span(culprit_text(rep))], id="card-culprit"))
    f = rep.get("first_anomaly")
    rows.append(html.Div([html.Span("First anomaly: ", className="k"),
                          html.Span(f"step {f['step']}, {f['rule']} ({f['severity']})"
                                    + (f" in {f['layer']} {f['tensor']}".rstrip() if f["layer"] else f" ({f['tensor']})")
                                    if f else "none"),
                          html.Div(f["message"], className="muted") if f else html.Span()], id="card-first"))
    o = rep.get("nan_origin")
    if o:
        rows.append(html.Div([html.Span("NaN origin: ", className="k"),
                              link(f"{o['layer']} {o['tensor']}", view="tensor", run=run, layer=o["layer"], role=o["tensor"]),
                              html.Span(f" at step {o['step']}")], id="card-nan"))
    if rep.get("coverage"):
        rows.append(html.Div(rep["coverage"], className="muted", id="card-coverage"))
    rows.append(html.Div([html.Span("What to try:", className="k"),
                          html.Ul([html.Li(a) for a in rep["advice"][:3]])], id="card-advice"))
    counts = ", ".join(f"{sev.get(s, 0)} {s}" for s in ("critical", "warning", "info"))
    tail = f"events: {counts} · {res['source']} · analysed through step {rep.get('last_step')}"
    if st["running"]:
        tail += " · updating..."
    rows.append(html.Div(tail, className="muted", id="card-counts"))
    return html.Div(rows, className="card", id="card")


# ---- events ---------------------------------------------------------------------------------
def events_panel(app, e, p, layer=None, role=None, timeline=True):
    ev = V.events(e)
    if ev is None:
        return note("The analysis is still running: events appear when it finishes.")
    if layer is not None:
        ev = ev[(ev["layer"] == layer) & (ev["tensor"].isna() | (ev["tensor"] == role))]
    if ev.empty:
        return note("No events" + (" on this tensor." if layer else " in this run: the detectors flagged nothing."))
    import plotly.graph_objects as go

    pe = plot_events(ev)
    fig = go.Figure()
    figures().severity_markers(fig, pe.assign(x=pe["step"], _s=pe["severity"],
                                              _t=pe["layer"].fillna("") + " " + pe["tensor"].fillna("")), "rule")
    fig.update_layout(title="event timeline (info hidden: click it in the legend)", height=260, xaxis_title="step",
                      yaxis_title="rule", margin={"l": 10, "r": 10, "t": 40, "b": 40})
    show_info = p.get("info") == "1"
    # numbers whatever the column's string dtype (an empty selection's map keeps the strings' dtype)
    rank = pd.to_numeric(ev["severity"].map(SEVERITY_RANK), errors="coerce").fillna(0)
    n_info = int((rank == 0).sum())
    keep = slice(None) if show_info else (rank > 0).to_numpy()
    listed = ev[keep].assign(_r=-rank[keep].to_numpy()).sort_values(["_r", "step"], kind="stable")
    pages = max(1, -(-len(listed) // EVENTS_PAGE))
    try:
        page = min(max(1, int(p.get("page") or 1)), pages)
    except ValueError:
        page = 1
    shown = listed.iloc[(page - 1) * EVENTS_PAGE: page * EVENTS_PAGE]
    rows = [[int(r["step"]), int(r["rank"]), r["severity"], r["rule"], r["layer"] if isinstance(r.get("layer"), str) and r["layer"] else "-",
             r["tensor"] if isinstance(r.get("tensor"), str) and r["tensor"] else "-", fmt(r.get("value")),
             fmt(r.get("threshold")), r.get("message") or ""] for r in shown.to_dict("records")]
    keep = {k: p.get(k) for k in ("view", "run", "layer", "role")}
    nav = [html.Span(f"{len(listed)} events" + ("" if show_info else f" at warning or above ({n_info} info hidden)")
                     + f", worst first; page {page} of {pages}. Click a row to open its tensor.  ", className="muted")]
    if page > 1:
        nav.append(link("< previous", **keep, info=p.get("info"), page=page - 1))
    if page < pages:
        nav += [html.Span(" "), link("next >", **keep, info=p.get("info"), page=page + 1)]
    if n_info:
        nav += [html.Span("  "), link("hide info events" if show_info else f"show {n_info} info events", **keep,
                                      info=None if show_info else "1")]
    body = (data_table("events-table", ["step", "rank", "severity", "rule", "layer", "tensor", "value", "threshold",
                                        "message"], rows, {0, 1, 6, 7}, wrap_cols={8}, page_size=EVENTS_PAGE)
            if rows else note("No events at warning or above."))
    return ([graph(fig, id="event-timeline")] if timeline else []) + [html.Div(nav, id="events-nav"), body]


# ---- Overview -------------------------------------------------------------------------------
def overview_body(app, e, p):
    F = figures()
    parts = [panel(card, app, e), panel(run_facts, e)]
    ev = V.events(e)
    names = [n for n in ("loss", "grad_norm") if n in Q.scalar_names(e)]
    if names:
        fig = F.scalars_with_events(Q.scalars_frame(e, names), plot_events(ev), title="loss and grad norm")
        parts.append(graph(fig, id="overview-scalars"))
    else:
        parts.append(note("No loss or grad_norm scalars logged in this run."))
    parts.append(panel(shadow_panel, app, e))
    parts.append(panel(events_panel, app, e, p))
    return parts


def run_facts(e):
    info = e.cached(("info",), e.run.info)
    rec = e.run.manifest.get("recipe") or {}
    if not info.get("steps"):
        return html.Div("No steps logged yet.", className="muted", id="run-facts")
    txt = (f"{info['steps']} steps (last {info['last_step']}), {info['tensors']} tensors, "
           f"ranks {info['ranks']}, {human(info['size_bytes'])}, last write {ago(info['last_write'])}; recipe: "
           + (", ".join(f"{k}={v}" for k, v in rec.items()) or "-"))
    return html.Div(txt, className="muted", id="run-facts")


def shadow_panel(app, e):
    import plotly.graph_objects as go

    sl = Q.shadow_loss_frame(e)
    rep = V.report(e)
    if sl is None:
        return note("No BF16 shadow in this run (no shadow_compare / shadow_fork table): FP8 vs BF16 is not available.")
    parts = []
    if not sl.empty:
        fig = go.Figure()
        fr = Q.scalars_frame(e, ["loss"]) if "loss" in Q.scalar_names(e) else None
        if fr is not None and len(fr):
            fig.add_trace(go.Scatter(x=fr["step"], y=fr["value"], mode="lines", name="training loss (fp8)",
                                     line={"color": "#bbb"}))
        for name, g in sl.groupby("name", sort=False):
            fig.add_trace(go.Scatter(x=g["step"], y=g["value"], mode="lines+markers", name=plot_label(name),
                                     marker={"size": 4}))
        fig.update_layout(title="FP8 vs BF16 shadow loss", height=300, xaxis_title="step", yaxis_title="loss",
                          margin={"l": 10, "r": 10, "t": 40, "b": 40})
        parts.append(graph(fig, id="overview-shadow"))
    if rep is None:
        return parts + [note("Fork verdicts and the FP8-vs-BF16 ranking appear when the analysis finishes.")]
    if rep.get("forks"):
        parts.append(html.H4("BF16 forks (FP8 vs BF16 from the same state)"))
        parts.append(table(["fork", "trigger", "steps", "verdict", "evidence"],
                           [[f["fork_id"], f["trigger"] or "-", f"{f['start_step']}..{f['last_step']}", f["verdict"],
                             f["reason"]] for f in rep["forks"]], {0}, id="forks-table", wrap_cols={4}))
    sh = rep.get("shadow")
    if sh:
        parts.append(html.H4("Where FP8 departs from BF16 (against each layer's own usual error)"))
        parts.append(html.Div(sh["verdict"], id="shadow-verdict"))
        if sh.get("worst_layers"):
            parts.append(table(["layer", "worst departure (x its usual error)", "max rel. error", "usual rel. error"],
                               [[w["layer"], fmt(w["max_departure"], ".2f"), fmt(w["max_rel_err"], ".2%"),
                                 fmt(w["baseline_rel_err"], ".2%")] for w in sh["worst_layers"]], {1, 2, 3},
                               id="shadow-table"))
    return parts


# ---- Heatmap --------------------------------------------------------------------------------
def stat_options(e):
    return [{"label": Q.STATS[k][0], "value": k} for k in Q.STATS if Q.STATS[k][3] == "tensors" or e.has(Q.STATS[k][3])]


def heatmap_params(e, p):
    rl = Q.roles(e)
    if not rl:
        raise NoData("No tensors table in this run yet: nothing to draw.")
    stat = p.get("stat") if p.get("stat") in Q.STATS else "headroom"
    role = p.get("role") if p.get("role") in rl else ("activation" if "activation" in rl else rl[0])
    agg = p.get("agg") if p.get("agg") in ("worst", "mean") else "worst"
    return rl, stat, role, agg


def step_controls(p):
    return [ctl("s0", dcc.Input, "from step", value=p.get("s0") or "", type="number", debounce=True,
                style={"width": "110px"}),
            ctl("s1", dcc.Input, "to step", value=p.get("s1") or "", type="number", debounce=True,
                style={"width": "110px"})]


def heatmap_controls(app, e, p):
    rl, stat, role, agg = heatmap_params(e, p)
    return html.Div([
        ctl("stat", dcc.Dropdown, "statistic", options=stat_options(e), value=stat, clearable=False,
            style={"width": "420px"}),
        ctl("role", dcc.Dropdown, "tensor role", options=[{"label": r, "value": r} for r in rl], value=role,
            clearable=False),
        ctl("agg", dcc.RadioItems, "per step bucket", options=[{"label": " worst ", "value": "worst"},
                                                               {"label": " mean", "value": "mean"}],
            value=agg, inline=True),
        ctl("q", dcc.Input, "layer filter (regex)", value=p.get("q") or "", debounce=True, type="text"),
        *step_controls(p),
    ], className="controls")


def flagged(e, role):
    ev = V.events(e)
    if ev is None or ev.empty:
        return ev
    m = ev["layer"].notna() & (ev["layer"] != "")
    if role:
        m &= ev["tensor"].isna() | (ev["tensor"] == role) | (ev["tensor"] == "")
    return ev[m]


def colour(fig, stat: str, fr: pd.DataFrame) -> str | None:
    """Honest colours: headroom on one fixed diverging scale centred on 0; percentages and counts from 0
    (step 0's initial scale does not set the scale for the rest); returns a note for all-zero data."""
    v = fr["value"].astype(float)
    sel = {"type": "heatmap"}
    if stat == "headroom":
        fig.update_traces(colorscale=HEADROOM_SCALE, zmin=HEADROOM_RANGE[0], zmax=HEADROOM_RANGE[1],
                          colorbar={"title": "binades", "tickvals": [-4, -2, 0, 2, 4, 8, 12],
                                    "ticktext": ["<= -4 overflow", "-2", "0", "2", "4", "8", ">= 12 wasted"]},
                          selector=sel)
        return None
    if stat.endswith("_pct") or stat in ("nonfinite",) or stat.startswith("shadow"):
        later = v[fr["step"] > fr["step"].min()] if fr["step"].nunique() > 1 else v
        top = float(np.nanquantile(later, 0.99)) if len(later) and np.isfinite(later).any() else 0.0
        top = max(top, float(v.max()) if stat == "nonfinite" else top)
        if not np.isfinite(top) or top <= 0:
            fig.update_traces(colorscale="Reds", zmin=0, zmax=1, selector=sel)
            return "Every value here is 0." if (v == 0).all() else None
        fig.update_traces(colorscale="Reds", zmin=0, zmax=top, selector=sel)
        return None
    fig.update_traces(colorscale="Viridis", reversescale=stat.endswith("sqnr_db"), selector=sel)
    return None


def heatmap_figure(app, e, stat, role, agg, layer_re, title=None, last_steps=None, span=None, zrange=None, x_range=None):
    res = V.analyser(e).state()["result"]
    key = ("heatmap_fig", stat, role, agg, layer_re, title, last_steps, span, zrange, x_range,
           res["at"] if res else None)
    return e.cached(key, lambda: _heatmap_figure(e, stat, role, agg, layer_re, title, last_steps, span, zrange, x_range),
                    rollup=True)


def _heatmap_figure(e, stat, role, agg, layer_re, title, last_steps, span, zrange, x_range):
    F = figures()
    fr = Q.heatmap_frame(e, stat, role, agg, layer_re, last_steps=last_steps, span=span)
    if fr.empty:
        raise NoData(f"No {Q.STATS[stat][0]} values for role {role!r}"
                     + (f" matching {layer_re!r}" if layer_re else "")
                     + (f" in steps {span[0]}..{span[1]}" if span else "")
                     + (" (cheap-stats steps carry only amax and scales)" if "pct" in stat else "") + ".")
    fr = fr.assign(layer=fr["layer"].map(plot_label))
    tensors = Q.STATS[stat][3] == "tensors"
    ev = flagged(e, role if Q.STATS[stat][3] in ("tensors", "recipes") else None)
    marks = []
    if ev is not None and not ev.empty:
        marks.append(plot_events(ev)[["layer", "step", "severity", "rule"]])
    nf = Q.nonfinite_cells(e, role) if tensors else pd.DataFrame()
    if len(nf):
        marks.append(nf.assign(layer=nf["layer"].map(plot_label), severity="critical", rule="non-finite"))
    fl = pd.concat(marks, ignore_index=True) if marks else None
    if fl is not None:
        fl = fl[(fl["step"] >= fr["step"].min()) & (fl["step"] <= fr["step"].max() + Q.heatmap_width(e) - 1)]
    fig = F.heatmap(fr, stat=Q.STATS[stat][0].split(",")[0].split("(")[0].strip(), flagged=fl, title=title)
    msg = colour(fig, stat, fr)
    first = int(fr["step"].min())
    scale_made = ("headroom", "underflow_pct", "underflow_shallow_pct", "below_normal_pct", "sqnr_db", "qerr_log10")
    if first == Q.step_span(e)[0] and not last_steps and stat in scale_made:
        # a labelled step, not a scored one: delayed scaling quantizes its first step with the initial scale
        fig.add_annotation(x=first, y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text="first step: no amax history", font={"size": 10, "color": "#555"})
    if zrange:
        fig.update_traces(zmin=zrange[0], zmax=zrange[1], selector={"type": "heatmap"})
    if x_range:
        fig.update_xaxes(range=list(x_range))
    fig.update_layout(uirevision=f"{stat}-{role}-{span}", yaxis_title="layer")
    return fig, fr, ev, fr["layer"].nunique(), msg


def heatmap_body(app, e, p):
    rl, stat, role, agg = heatmap_params(e, p)
    q = p.get("q") or None
    span = Q.clip_span(e, span_of(p), Q.STATS[stat][3])
    fig, fr, ev, n_layers, empty_msg = heatmap_figure(app, e, stat, role, agg, q, span=span)
    steps = np.sort(fr["step"].unique())
    b = int(steps[1] - steps[0]) if len(steps) > 1 else 1
    msg = (f"{n_layers} layers x {len(steps)} columns" + (f" (steps {span[0]}..{span[1]})" if span else "")
           + f"; each column covers {b} step(s), colour = {'worst' if agg == 'worst' else 'mean'} value in it. "
           "Markers: warning and critical events, non-finite cells (info events: click them in the legend). "
           "Drag to zoom: the columns re-bucket to the range. Click a cell to open that tensor.")
    if stat.startswith("shadow"):
        msg += " Shadow error is per layer (role does not apply)."
    if stat.startswith("recipe_"):
        msg += (" A what-if recipe, measured on this run's tensors on full-stats steps only; the Recipes view "
                "ranks them.")
    if stat == "headroom":
        msg += (" Headroom: red = the amax overflowed the range the scale could represent, grey = normal, blue = "
                "range wasted (a stale or reset scale).")
    extra = [note(empty_msg)] if empty_msg else []
    if ev is None:
        extra.append(note("The analysis is still running: event markers appear when it finishes."))
    return [html.Div(msg, className="muted"), *extra, graph(fig, id="heatmap-graph")]


# ---- Outliers -------------------------------------------------------------------------------
def role_filter_controls(app, e, p):
    """One optional role filter: the controls of the Outlier layers and Recipes views."""
    rl = Q.roles(e)
    role = p.get("role") if p.get("role") in rl else None
    return html.Div([ctl("role", dcc.Dropdown, "tensor role (empty = all)",
                         options=[{"label": r, "value": r} for r in rl], value=role)], className="controls")


outliers_controls = role_filter_controls


def outliers_body(app, e, p):
    rl = Q.roles(e)
    role = p.get("role") if p.get("role") in rl else None
    df = outliers(e, role, events=V.events(e))
    rows = [[i + 1, r["layer"], r["tensor"], r["severity"], fmt(r["score"], ".2f"), fmt(r["z"], ".1f"), fmt(r["dev"], ".2f"),
             int(r["peers"]), fmt(r["step"], ".0f") if r["step"] is not None else "-", fmt(r["max_amax"]),
             fmt(r["min_headroom"], ".2f"), fmt(r["underflow_pct"], ".2f"), fmt(r["saturated_pct"], ".2f"),
             int(r["nonfinite"]), f"{int(r['critical'])}/{int(r['warning'])}"] for i, r in df.iterrows()]
    cols = ["#", "layer", "role", "layer_outlier", "score", "z (peers)", "binades above peers", "peers", "at step",
            "max amax", "min headroom", "max underflow %", "max saturation %", "non-finite", "events crit/warn"]
    if not rows:
        return note("No tensors for this role.")
    return [html.Div(score_doc() + " Click a row to open that tensor.", className="muted"),
            data_table("outliers-table", cols, rows, {0} | set(range(4, 15)))]


# ---- Recipes (the advisor) ------------------------------------------------------------------
recipes_controls = role_filter_controls


def recipes_body(app, e, p):
    """Each recipe the run measured on its own tensors, and the advisor's verdict: the one analysis
    of ``fp8scope whatif`` (``fp8scope.detect.advisor``)."""
    from fp8scope.detect.advisor import NAMES, advise, fault, per_step, summed

    if not e.has("recipes"):
        return note("This run measured no other recipe. Monitor(..., whatif_recipes=[\"current\", \"mxfp8\", "
                    "\"block128\", \"nvfp4\", \"bf16\"]) measures them on full-stats steps.", id="recipes-none")
    rows = e.cached(("advisor-rows",), lambda: per_step(e.run))
    table = e.cached(("advisor-table",), lambda: summed(rows))
    advice, summary = e.cached(("advisor-advice",), lambda: advise(rows))
    rl = Q.roles(e)
    role = p.get("role") if p.get("role") in rl else None
    shown = table if role is None else table[table["tensor"] == role]
    from fp8scope.detect.config import DetectConfig

    cfg = DetectConfig()
    rows = [[r.layer, r.tensor, NAMES.get(r.recipe, r.recipe), fmt(100 * r.underflow_frac, ".3g"),
             fmt(100 * r.overflow_frac, ".3g"), fmt(r.sqnr_db, ".1f"), fault(r._asdict(), cfg) or ""]
            for r in shown.itertuples(index=False)]
    verdict = ([html.Li(a.text()) for a in advice] if advice
               else [html.Li("No tensor is at fault under the recipe in use: nothing to change.")])
    return [html.H3("Advice"), html.Ul(verdict, id="recipes-advice"),
            html.Ul([html.Li(line) for line in summary], id="recipes-summary", className="muted"),
            data_table("recipes-table", ["layer", "role", "recipe", "underflow %", "overflow %", "SQNR dB", "fault"],
                       rows, {3, 4, 5})]


# ---- Tensor ---------------------------------------------------------------------------------
def tensor_pick(e, p):
    """(layers, roles, layer, role, problem): the URL's tensor, or the report's culprit, or the top
    outlier; a layer the run does not have is said, never swapped silently for another."""
    order = Q.layer_order(e)
    if order.empty:
        raise NoData("No tensors table in this run yet.")
    layers, rl = list(order["layer"]), Q.roles(e)
    layer, role = p.get("layer"), p.get("role")
    if layer is not None and layer not in layers:
        return layers, rl, None, role, f"This run has no layer named {layer!r}: pick one above."
    if role is not None and role not in rl:
        return layers, rl, layer, None, f"This run has no tensor role {role!r}: pick one above."
    if layer is None:
        rep = V.report(e)
        c = (rep or {}).get("culprit")
        if c and c["layer"] in layers and c["tensor"] in rl:
            layer, role = c["layer"], c["tensor"]
        else:
            top = outliers(e, None)
            layer, role = (top["layer"].iloc[0], top["tensor"].iloc[0]) if len(top) else (layers[0], rl[0])
    return layers, rl, layer, role or rl[0], None


def tensor_controls(app, e, p):
    layers, rl, layer, role, _ = tensor_pick(e, p)
    return html.Div([
        ctl("layer", dcc.Dropdown, "layer", options=[{"label": l, "value": l} for l in layers], value=layer,
            clearable=False, style={"width": "420px"}),
        ctl("role", dcc.Dropdown, "tensor role", options=[{"label": r, "value": r} for r in rl], value=role,
            clearable=False),
        *step_controls(p),
    ], className="controls")


def tensor_body(app, e, p):
    import plotly.graph_objects as go

    layers, rl, layer, role, problem = tensor_pick(e, p)
    if problem:
        return note(problem, id="tensor-problem")
    F = figures()
    span = Q.clip_span(e, span_of(p))
    s = Q.tensor_series(e, layer, role, span=span)
    if s.empty:
        raise NoData(f"No rows for {layer} / {role} in this run" + (f" in steps {span[0]}..{span[1]}" if span else "") + ".")
    ev = V.events(e)
    ev_t = None if ev is None or ev.empty else ev[(ev["layer"] == layer) & (ev["tensor"].isna() | (ev["tensor"] == role))]
    from plotly.subplots import make_subplots

    # one figure of three rows on one step axis: Chromium draws one plotly figure much faster than three
    top = F.amax_vs_range(s, plot_label(layer), role, events=plot_events(ev_t))
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07, row_heights=[0.5, 0.22, 0.28],
                        subplot_titles=["amax vs representable range fp8_max * scale_inv",
                                        "scale_inv (rising = scale collapsing)",
                                        "overflow / underflow / saturation % (full-stats steps)"])
    for tr in top.data:
        fig.add_trace(tr, row=1, col=1)
    fig.add_trace(go.Scatter(x=s["step"], y=s["expected_amax"], mode="lines", name="expected amax (recipe)",
                             line={"dash": "dot"}), row=1, col=1)
    fig.add_trace(go.Scatter(x=s["step"], y=s["scale_inv"], mode="lines", name="scale_inv"), row=2, col=1)
    for c, n in (("overflow_pct", "overflow %"), ("underflow_pct", "underflow % (of non-zeros)"),
                 ("underflow_shallow_pct", "underflow % pressed under (not a near-zero tail)"),
                 ("below_normal_pct", "% under the normal range (flushed or subnormal: where the bulk sits)"),
                 ("saturated_pct", "saturation %")):
        d = s[s[c].notna()]
        fig.add_trace(go.Scatter(x=d["step"], y=d[c], mode="lines+markers", name=n, marker={"size": 4}), row=3, col=1)
    for recipe, d in Q.recipe_series(e, layer, role, span).groupby("recipe", sort=False):
        # what the measured recipes would have done, on the same steps (click the legend to show)
        fig.add_trace(go.Scatter(x=d["step"], y=d["underflow_pct"], mode="lines+markers", visible="legendonly",
                                 name=f"underflow % under {Q.RECIPE_NAMES.get(recipe, recipe)} (what-if)",
                                 line={"dash": "dash"}, marker={"size": 4}), row=3, col=1)
    if len(s) and int(s["step"].iloc[0]) == (Q.step_span(e) or (0, 0))[0]:
        fig.add_annotation(x=int(s["step"].iloc[0]), y=0.28, yref="paper", yanchor="bottom", showarrow=False,
                           text="first step: no amax history", font={"size": 10, "color": "#555"})
    fig.update_yaxes(log_axis(title="|x|"), row=1, col=1)
    fig.update_yaxes(log_axis(title="scale_inv"), row=2, col=1)
    fig.update_yaxes(title_text="%", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(height=760, showlegend=True, uirevision=f"{layer}-{role}-{span}",
                      margin={"l": 10, "r": 10, "t": 40, "b": 40})
    width = int(s["step"].iloc[1] - s["step"].iloc[0]) if len(s) > 1 else 1
    recipe = s["recipe"].iloc[-1]  # queries.TENSOR_SERIES; None in runs logged before the column
    meta = (f"{layer} / {role}: format {s['fp8_format'].iloc[-1]}, source {s['source'].iloc[-1]}"
            + (f", recipe {recipe}" if isinstance(recipe, str) else "") + f"; {len(s)} points, "
            f"{width} step(s) each (worst value per bucket)" + (f", steps {span[0]}..{span[1]}" if span else "")
            + ". Drag to zoom: the points re-bucket to the range.")
    return [html.H3(f"{layer} / {role}", id="tensor-title"), html.Div(meta, className="muted"), graph(fig, id="tensor-amax"),
            html.H4("Events on this tensor (also marked on the amax figure)"),
            panel(events_panel, app, e, p, layer=layer, role=role, timeline=False)]


# ---- Compare --------------------------------------------------------------------------------
def compare_controls(app, e, p):
    names = app.root.list_runs()
    rl = Q.roles(e)
    stat = p.get("stat") if p.get("stat") in Q.STATS else "headroom"
    role = p.get("role") if p.get("role") in rl else ("activation" if "activation" in rl else (rl[0] if rl else None))
    return html.Div([
        ctl("b", dcc.Dropdown, "compare with", options=[{"label": n, "value": n} for n in names if n != p["run"]],
            value=p.get("b") if p.get("b") in names else None, style={"width": "320px"}),
        ctl("stat", dcc.Dropdown, "statistic", options=stat_options(e), value=stat, clearable=False,
            style={"width": "380px"}),
        ctl("role", dcc.Dropdown, "tensor role", options=[{"label": r, "value": r} for r in rl], value=role,
            clearable=False),
    ], className="controls")


def compare_body(app, e, p):
    import plotly.graph_objects as go

    from dashboard.paths import PathRejected
    from fp8scope.errors import Fp8ScopeError

    b_name = p.get("b")
    if not b_name:
        return note("Pick a second run to compare with.")
    try:
        e2 = app.cache.get(app.root.resolve(b_name))
    except PathRejected as exc:
        return error_card("Refused", str(exc))
    except Fp8ScopeError as exc:
        return error_card("Run B could not be read", str(exc).splitlines()[0])
    rl = Q.roles(e)
    stat = p.get("stat") if p.get("stat") in Q.STATS else "headroom"
    role = p.get("role") if p.get("role") in rl else ("activation" if "activation" in rl else (rl[0] if rl else None))
    runs = ((e, p["run"], RUN_COLORS[0]), (e2, b_name, RUN_COLORS[1]))
    spans = [Q.step_span(x, "scalars") or Q.step_span(x) for x, _, _ in runs]
    spans = [s for s in spans if s]
    x_range = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None
    loss = [Q.scalars_frame(x, ["loss"]) for x, _, _ in runs]
    split = Q.first_divergence(loss[0], loss[1]) if all(len(x) for x in loss) else None

    fig = go.Figure()
    for (ent, nm, colr), lf in zip(runs, loss):
        for sc, dash, axis in (("loss", "solid", "y"), ("grad_norm", "dot", "y2")):
            fr = lf if sc == "loss" else Q.scalars_frame(ent, [sc])
            if len(fr):
                fig.add_trace(go.Scatter(x=fr["step"], y=fr["value"], mode="lines", name=plot_label(f"{nm}: {sc}"),
                                         yaxis=axis, line={"color": colr, "dash": dash}, legendgroup=nm))
    if not fig.data:
        return note("Neither run logged loss or grad_norm.")
    if split is not None:
        fig.add_vline(x=split, line={"color": "#444", "dash": "dash"}, annotation_text=f"runs part at step {split}")
    fig.update_layout(title="loss (solid, left) and grad norm (dotted, right): one colour per run", height=340,
                      xaxis={"title": "step", "range": list(x_range) if x_range else None},
                      yaxis={"title": "loss"}, yaxis2=log_axis(title="grad norm", overlaying="y", side="right"),
                      margin={"l": 10, "r": 10, "t": 40, "b": 40})
    parts = [html.Div(f"The runs part ways at step {split} (loss differs by 5 % or more for 3 logged steps in a row)."
                      if split is not None else "The two runs' losses never part ways by 5 % or more.",
                      className="muted", id="compare-split"), graph(fig, id="compare-loss")]

    def frame(ent):
        try:
            return Q.heatmap_frame(ent, stat, role)["value"]
        except NoData:
            return pd.Series(dtype=float)

    v = pd.concat([frame(e), frame(e2)])
    zr = None
    if stat != "headroom" and len(v) and np.isfinite(v).any():
        zr = (float(np.nanmin(v)), float(np.nanmax(v)))
        if zr[0] == zr[1]:
            zr = (zr[0], zr[0] + 1)

    def side(ent, nm, key):
        fig, *_ = heatmap_figure(app, ent, stat, role, "worst", None, title=plot_label(nm), zrange=zr, x_range=x_range)
        if split is not None:
            fig.add_vline(x=split, line={"color": "#444", "dash": "dash"})
        return graph(fig, id=f"compare-heat-{key}")

    parts += [html.Div("Both heatmaps use one colour scale and one step axis.", className="muted"),
              html.Div([html.Div(panel(side, e, p["run"], "a")), html.Div(panel(side, e2, b_name, "b"))],
                       className="row2")]
    return parts


# ---- Live -----------------------------------------------------------------------------------
def live_body(app, e, p):
    F = figures()
    st = run_status(e.path, app.cache)
    last = _last_step_sql(e)
    head = html.Div([html.Span(st["status"], className=f"status status-{st['status']}"),
                     html.Span("  last step ", className="muted"), html.B("-" if last is None else str(last), id="live-last-step"),
                     html.Span(f"  · last write {ago(st['last_write'])} · refreshed {time.strftime('%H:%M:%S')} "
                               "(reads only bytes appended since the last refresh)", className="muted")], className="card")
    parts = [head, panel(card, app, e)]
    names = [n for n in ("loss", "grad_norm") if n in Q.scalar_names(e)]
    ev = V.events(e)
    if names:
        parts.append(graph(F.scalars_with_events(Q.scalars_frame(e, names, last_steps=500), plot_events(ev),
                                                 title="last 500 steps"), id="live-scalars"))
    rl = Q.roles(e)
    if rl:
        role = "activation" if "activation" in rl else rl[0]
        parts.append(panel(lambda: graph(heatmap_figure(app, e, "headroom", role, "worst", None,
                                                        title=f"amax headroom, {role}, last 300 steps",
                                                        last_steps=300)[0], id="live-heatmap")))
    if ev is not None and not ev.empty:
        serious = ev[ev["severity"].map(SEVERITY_RANK).fillna(0) > 0]
        parts.append(html.H4("Latest warning and critical events"))
        parts.append(table(["step", "severity", "rule", "layer", "tensor", "message"],
                           [[int(r["step"]), r["severity"], r["rule"], r["layer"] or "-", r["tensor"] or "-", r["message"]]
                            for r in serious.tail(20).iloc[::-1].to_dict("records")], {0}, id="live-events",
                           wrap_cols={5}) if len(serious) else note("No warning or critical events yet."))
    return parts


# ---- Runs -----------------------------------------------------------------------------------
def runs_body(app, p):
    names = app.root.list_runs()
    if not names:
        return note(f"No runs under {app.root.root} yet. Point a Monitor at a folder inside it.")
    rows = []
    recent: list[tuple[float, str]] = []
    for n in names:
        s = run_status(app.root.root / n, app.cache)
        if s["status"] in ("live", "finished", "crashed") and s["last_write"] is not None:
            recent.append((s["last_write"], n))
        if s["events"] is None:
            ev = "not analysed yet (opening the run analyses it)"
        else:
            ev = (", ".join(f"{s['events'].get(k, 0)} {k}" for k in Q.SEVERITIES if s["events"].get(k)) or "none")
            ev += "" if s["events_source"] == "analysis" else f" ({s['events_source']})"
        status = html.Span(s["status"], className=f"status status-{s['status']}")
        if s["status"] == "error":
            rows.append([html.Span(n), status, html.Span(s["error"], className="muted"), "", "", "", ""])
            continue
        rows.append([link(n, view="overview", run=n), status, fmt(s["last_step"], "d") if s["last_step"] is not None else "-",
                     ago(s["last_write"]), human(s["size"]), ev, s["created"] or "-"])
    # the most recently written runs are the ones users open: load them (and warm them up) meanwhile
    app.cache.preload([app.root.root / n for _, n in sorted(recent, reverse=True)[:PRELOAD_RUNS]])
    return [html.H3(f"Runs under {app.root.root}"),
            html.Div("live: written to in the last 2 minutes and streams still open; finished: every stream "
                     "closed cleanly; crashed: streams not closed and nothing written for 2 minutes; error: the run "
                     "cannot be read.", className="muted"),
            table(["run", "status", "last step", "last write", "size", "events", "created"], rows, {2, 4}, id="runs-table")]


def runs_controls(app, p):
    names = app.root.list_runs()
    opts = [{"label": n, "value": n} for n in names]
    a, b = p.get("run"), p.get("b")
    return html.Div([
        html.H4("Open or compare"),
        html.Div([ctl("run", dcc.Dropdown, "run A", options=opts, value=a, style={"width": "320px"}),
                  ctl("b", dcc.Dropdown, "run B (optional)", options=opts, value=b, style={"width": "320px"}),
                  html.Div([link("open A", view="overview", run=a) if a else html.Span(""),
                            html.Span("  "),
                            link("compare A and B", view="compare", run=a, b=b) if a and b else html.Span("")],
                           id="runs-actions")],
                 className="controls"),
    ], className="card")
