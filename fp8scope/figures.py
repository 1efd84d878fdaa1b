"""Reusable plotly figure builders (used by ``fp8scope report --html`` and the dashboard).

Every builder takes small pandas DataFrames and returns a ``plotly.graph_objects.Figure``.
Big runs are downsampled *before* they get here, on the server side, with the ``*_frame``
helpers below (DuckDB aggregation over the run's Arrow tables): a 10k-step x 1k-tensor run
becomes at most ``max_steps`` step buckets per series, so figures stay a few hundred KB.

Builders:

* :func:`heatmap` - layer x step heatmap of one statistic, flagged cells marked.
* :func:`amax_vs_range` - one tensor's amax against the range its scale could represent
  (``fp8_max * scale_inv``), with saturation steps marked.
* :func:`scalars_with_events` - loss / grad-norm (any scalar) with event markers.

Frame helpers (each takes a :class:`fp8scope.run.Run`):

* :func:`heatmap_frame` - columns ``layer, step, value`` (bucketed, max per bucket).
* :func:`tensor_range_frame` - columns ``step, amax, range, expected_amax, min_nonzero``.
* :func:`scalars_frame` - columns ``step, name, value``.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from fp8scope.derived import DERIVED

SEVERITY_COLORS = {"info": "#1f77b4", "warning": "#ff7f0e", "critical": "#d62728"}

# Stats a heatmap can show, as SQL expressions over the tensors table (per row): the raw amax and the
# one table of derived statistics (fp8scope.derived).
HEATMAP_STATS = {"amax": "amax", **{k: d.sql for k, d in DERIVED.items()}}


def _go():
    import plotly.graph_objects as go

    return go


# ---- server-side downsampling ------------------------------------------------------------
def _bucket(run, max_steps: int) -> int:
    info = run.sql("select min(step) as lo, max(step) as hi from tensors")
    if info.empty or pd.isna(info["lo"].iloc[0]):
        return 1
    span = int(info["hi"].iloc[0]) - int(info["lo"].iloc[0]) + 1
    return max(1, -(-span // max(1, max_steps)))


def _sql_str(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def heatmap_frame(run, stat: str = "log2_amax", tensor: str | None = "activation", max_steps: int = 400,
                  rank: int | None = None) -> pd.DataFrame:
    """Per (layer, step bucket) the max of ``stat`` (a key of HEATMAP_STATS). Columns layer, step, value.

    ``step`` is the first step of each bucket; buckets are ``ceil(span / max_steps)`` steps wide.
    Layers come back in execution order (min ``order``).
    """
    if stat not in HEATMAP_STATS:
        from fp8scope.errors import UsageError

        raise UsageError(f"unknown heatmap stat {stat!r}; choose from {', '.join(HEATMAP_STATS)}")
    b = _bucket(run, max_steps)
    where = []
    if tensor:
        where.append(f"tensor = {_sql_str(tensor)}")
    if rank is not None:
        where.append(f"rank = {int(rank)}")
    w = ("where " + " and ".join(where)) if where else ""
    expr = HEATMAP_STATS[stat]
    q = f"""
        select layer, (step // {b}) * {b} as step,
               max(case when isfinite(v) then v else null end) as value,
               min("order") as ord
        from (select layer, step, "order", cast({expr} as double) as v from tensors {w})
        group by 1, 2 order by ord, step
    """
    df = run.sql(q)
    return df[["layer", "step", "value"]]


def tensor_range_frame(run, layer: str, tensor: str, max_steps: int = 2000, rank: int | None = None) -> pd.DataFrame:
    """One tensor's amax and representable range per step bucket (max amax, min range per bucket)."""
    b = _bucket(run, max_steps)
    rw = f"and rank = {int(rank)}" if rank is not None else ""
    q = f"""
        select (step // {b}) * {b} as step,
               max(amax) as amax,
               min(fp8_max * scale_inv) as range,
               max(expected_amax) as expected_amax,
               min(min_nonzero) as min_nonzero
        from tensors where layer = {_sql_str(layer)} and tensor = {_sql_str(tensor)} {rw}
        group by 1 order by 1
    """
    return run.sql(q)


def scalars_frame(run, names: Iterable[str] = ("loss", "grad_norm"), max_steps: int = 2000) -> pd.DataFrame:
    """Scalars per step bucket (max over ranks and bucket). Columns step, name, value."""
    names = list(names)
    if "scalars" not in run.table_names() or not names:
        return pd.DataFrame({"step": [], "name": [], "value": []})
    span = run.sql("select min(step) lo, max(step) hi from scalars")
    lo, hi = span["lo"].iloc[0], span["hi"].iloc[0]
    b = 1 if pd.isna(lo) else max(1, -(-(int(hi) - int(lo) + 1) // max_steps))
    in_list = ", ".join(_sql_str(n) for n in names)
    return run.sql(
        f"select (step // {b}) * {b} as step, name, max(value) as value from scalars "
        f"where name in ({in_list}) group by 1, 2 order by 2, 1"
    )


# ---- figure builders -------------------------------------------------------------------
def heatmap(frame: pd.DataFrame, stat: str = "log2_amax", flagged: pd.DataFrame | None = None,
            title: str | None = None, height: int | None = None):
    """Layer x step heatmap. ``frame``: columns layer, step, value (see :func:`heatmap_frame`).

    ``flagged``: optional frame with columns layer, step (and optionally severity, rule) marked
    with an "x" on top of the heatmap (events; steps are snapped to the frame's step buckets).
    """
    go = _go()
    fig = go.Figure()
    if frame is None or frame.empty:
        fig.update_layout(title=title or f"{stat}: no data")
        return fig
    layers = list(dict.fromkeys(frame["layer"]))  # keep the given (execution) order
    steps = np.sort(frame["step"].unique())
    pivot = frame.pivot_table(index="layer", columns="step", values="value", aggfunc="max").reindex(
        index=layers, columns=steps)
    fig.add_trace(go.Heatmap(z=pivot.to_numpy(dtype=float), x=steps, y=layers, colorscale="Viridis",
                             colorbar={"title": stat}, hovertemplate="step %{x}<br>%{y}<br>" + stat + " %{z:.4g}<extra></extra>"))
    if flagged is not None and not flagged.empty:
        f = flagged[flagged["layer"].isin(layers)].copy()
        if not f.empty:
            idx = np.searchsorted(steps, f["step"].to_numpy(), side="right") - 1
            f["x"] = steps[np.clip(idx, 0, len(steps) - 1)]
            sev = f["severity"] if "severity" in f else pd.Series("warning", index=f.index)
            text = (f["rule"].astype(str) if "rule" in f else sev.astype(str)) + " @ step " + f["step"].astype(str)
            f = f.assign(_t=text.to_numpy(), _s=sev.to_numpy())
            severity_markers(fig, f.drop_duplicates(["x", "layer", "_t"]), "layer", on_cells=True)
    fig.update_layout(title=title or f"{stat} per layer and step", xaxis_title="step",
                      yaxis={"autorange": "reversed", "type": "category"},
                      height=height or max(300, min(1200, 18 * len(layers) + 120)),
                      margin={"l": 10, "r": 10, "t": 40, "b": 40}, showlegend=True,
                      legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"})
    return fig


# Event markers: drawn info, then warning, then critical (last, so on top), each severity its own shape;
# info is listed in the legend but hidden until clicked (it is context, not news).
_MARKERS = {"info": ("circle-open", 7), "warning": ("x", 9), "critical": ("x", 13)}
# on a heatmap the cells already use red and orange: markers are black with a white rim there
_ON_CELLS = {"info": "#555555", "warning": "#444444", "critical": "#000000"}


def severity_markers(fig, f: pd.DataFrame, ycol: str, y=None, max_points: int = 2000, on_cells: bool = False) -> None:
    """Event markers, one trace per severity in drawing order; ``f``: columns x, ``ycol`` (or ``y(g)``),
    ``_s`` (severity) and ``_t`` (hover text)."""
    go = _go()
    for sev in ("info", "warning", "critical"):
        g = f[f["_s"] == sev].head(max_points)
        if g.empty:
            continue
        sym, size = _MARKERS[sev]
        if on_cells:
            sym = {"info": "circle-open", "warning": "diamond", "critical": "x"}[sev]
        colour = (_ON_CELLS if on_cells else SEVERITY_COLORS)[sev]
        rim = "#ffffff" if on_cells else colour
        fig.add_trace(go.Scatter(
            x=g["x"], y=g[ycol] if y is None else y(g), mode="markers", name=f"{sev} events",
            visible="legendonly" if sev == "info" else True,
            marker={"symbol": sym, "size": size, "color": colour,
                    "line": {"width": 1.5 if on_cells and sev != "info" else 1, "color": rim}},
            text=g["_t"], hovertemplate="%{text}<br>%{y}<extra>" + sev + "</extra>"))


def amax_vs_range(frame: pd.DataFrame, layer: str = "", tensor: str = "", events: pd.DataFrame | None = None,
                  title: str | None = None):
    """One tensor's amax vs the representable range ``fp8_max * scale_inv`` (log y axis).

    ``frame``: columns step, amax, range (optionally min_nonzero); see :func:`tensor_range_frame`.
    Steps where amax > range (saturation) get red markers; ``events`` (step, rule, severity)
    become vertical ticks.
    """
    go = _go()
    fig = go.Figure()
    name = f"{layer} {tensor}".strip()
    if frame is None or frame.empty:
        fig.update_layout(title=title or f"{name}: no data")
        return fig
    fig.add_trace(go.Scatter(x=frame["step"], y=frame["amax"], mode="lines", name="amax"))
    fig.add_trace(go.Scatter(x=frame["step"], y=frame["range"], mode="lines", name="representable max",
                             line={"dash": "dash"}))
    if "min_nonzero" in frame and frame["min_nonzero"].notna().any():
        fig.add_trace(go.Scatter(x=frame["step"], y=frame["min_nonzero"], mode="markers", name="min non-zero",
                                 marker={"size": 3}, opacity=0.5))
    sat = frame[frame["amax"] > frame["range"] * (1 + 1e-6)]
    if not sat.empty:
        fig.add_trace(go.Scatter(x=sat["step"], y=sat["amax"], mode="markers", name="saturated",
                                 marker={"color": "#d62728", "size": 8, "symbol": "triangle-up"}))
    if events is not None and not events.empty:
        for sev, grp in events.groupby("severity"):
            y = frame["amax"].max()
            fig.add_trace(go.Scatter(x=grp["step"], y=[y] * len(grp), mode="markers", name=f"{sev} events",
                                     visible="legendonly" if sev == "info" else True,
                                     marker={"symbol": "line-ns-open", "size": 14,
                                             "color": SEVERITY_COLORS.get(sev, "#d62728")},
                                     text=grp["rule"] if "rule" in grp else None))
    fig.update_layout(title=title or f"{name}: amax vs representable range", xaxis_title="step",
                      yaxis={"type": "log", "title": "|x|", "dtick": 1, "exponentformat": "power"}, height=320,
                      margin={"l": 10, "r": 10, "t": 40, "b": 40})
    return fig


def scalars_with_events(frame: pd.DataFrame, events: pd.DataFrame | None = None, title: str | None = None,
                        log_y: bool = True):
    """Scalars (``frame``: step, name, value) as lines; ``events`` (step, rule, severity) as markers."""
    go = _go()
    from plotly.subplots import make_subplots

    names = list(dict.fromkeys(frame["name"])) if frame is not None and not frame.empty else []
    if not names:
        fig = go.Figure()
        fig.update_layout(title=title or "no scalars")
        return fig
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, subplot_titles=names, vertical_spacing=0.08)
    for i, n in enumerate(names, start=1):
        d = frame[frame["name"] == n]
        fig.add_trace(go.Scatter(x=d["step"], y=d["value"], mode="lines", name=n), row=i, col=1)
        if events is not None and not events.empty and len(d):
            ev = events.sort_values("step").assign(x=lambda t: t["step"])
            ev = ev.assign(_s=ev["severity"].astype(str),
                           _t=(ev["rule"].astype(str) if "rule" in ev else ev["severity"].astype(str))
                           + " @ step " + ev["step"].astype(str)).drop_duplicates(["step", "_s"])
            ys = d["value"].astype(float).fillna(0)
            n0 = len(fig.data)
            severity_markers(fig, ev, "step", y=lambda g: np.interp(g["step"], d["step"], ys))
            for tr in fig.data[n0:]:
                tr.update(xaxis=f"x{'' if i == 1 else i}", yaxis=f"y{'' if i == 1 else i}", showlegend=i == 1,
                          legendgroup=tr.name)
        v = d["value"].astype(float)
        if log_y and len(v) and (v > 0).all() and v.max() > 10 * v.min():  # log only across decades:
            fig.update_yaxes(type="log", dtick=1, exponentformat="power", row=i, col=1)  # ticks 10^k, unambiguous
        fig.update_yaxes(title_text=n, row=i, col=1)
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    fig.update_layout(title=title or "training scalars", height=220 * len(names) + 60, showlegend=True,
                      legend={"orientation": "h", "y": 1.05, "x": 1, "xanchor": "right", "yanchor": "bottom"},
                      margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return fig
