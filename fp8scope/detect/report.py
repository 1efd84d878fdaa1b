"""The post-mortem: events + statistics -> the story of a run (dict), as text, JSON or one HTML file.

``build_report(run, config)`` returns a JSON-able dict:

* ``first_anomaly`` / ``nan_origin``: ``{step, layer, tensor, rule, severity, message}`` or None;
* ``top_layers``: the layers with the most severe evidence, each with its events and numbers;
* ``scalars``: loss / grad-norm context around the first anomaly;
* ``shadow``: the FP8-vs-BF16 verdict when the run has shadow tables;
* ``advice``: concrete next steps derived from the rules that fired.

``render_html(report, run, events, path)`` writes a single self-contained HTML file (plotly JS
inlined) with a layer x step heatmap and the flagged tensors' amax against the range their
scale could represent. Every name and message is escaped.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pandas as pd

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.design_loss import BLOCK_SCALED
from fp8scope.detect.engine import SIMULATED_CAST
from fp8scope.detect.harm import training_harm
from fp8scope.detect.rules import SEVERITY_RANK
from fp8scope.schema import ROLES, base_role, simulated_casts
from fp8scope.store.manifest import coverage_of, coverage_text, describe_mode, measured_mode, recipe_text

WARN = SEVERITY_RANK["warning"]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def _ev(r: dict | pd.Series | None) -> dict | None:
    if r is None:
        return None
    r = dict(r)
    return {"step": int(r["step"]), "rank": int(r["rank"]), "layer": r["layer"], "tensor": r["tensor"],
            "rule": r["rule"], "severity": r["severity"], "value": _clean(r["value"]), "message": r["message"]}


def build_report(run, config: DetectConfig | None = None, events: pd.DataFrame | None = None,
                 progress=None) -> dict:
    from fp8scope.detect.engine import detect

    cfg = config or DetectConfig()
    tick = progress or (lambda phase: None)
    ev = events if events is not None else detect(run, cfg, progress=tick)
    tick("summarising")
    sev = ev["severity"].map(SEVERITY_RANK).fillna(0) if not ev.empty else pd.Series(dtype=float)
    serious = ev[sev >= WARN] if not ev.empty else ev
    info = run.info()
    manifest = run.manifest
    meta = manifest.get("meta") or {}
    rep: dict[str, Any] = {
        "run": str(run.path),
        "steps": info["steps"], "first_step": info["first_step"], "last_step": info["last_step"],
        "ranks": info["ranks"], "tensors": info["tensors"],
        "recipe": manifest.get("recipe"),
        "measured": measured_mode(manifest),
        "planted": _planted(meta),
        "events": {
            "total": int(len(ev)),
            "by_severity": {s: int((ev["severity"] == s).sum()) for s in ("critical", "warning", "info")},
            "by_rule": {k: int(v) for k, v in ev["rule"].value_counts().items()} if not ev.empty else {},
        },
    }
    first = serious.sort_values(["step", "rank"], kind="stable").iloc[0] if not serious.empty else None
    rep["first_anomaly"] = _ev(first)
    nan = ev[ev["rule"] == "nan_origin"] if not ev.empty else ev
    rep["nan_origin"] = _ev(nan.iloc[0]) if not nan.empty else None
    rep["whatif_layers"] = whatif_layers(manifest)
    rep["layer_recipes"] = layer_recipes(manifest)
    rep["coverage"] = coverage_text(manifest)
    rep["attribution"] = attribution(serious, rep["whatif_layers"])
    rep["nan_upstream"] = unmonitored_upstream(manifest, rep["nan_origin"])
    rep["top_layers"] = _top_layers(serious, rep["whatif_layers"])
    scalars = _scalar_frame(run, cfg)
    rep["scalars"] = _scalar_context(scalars, cfg, rep["first_anomaly"])
    rep["harm"] = (training_harm(_series(scalars, cfg.loss_name), serious, rep["attribution"]["event"], cfg)
                   if rep["attribution"]["side"] == "fp8" else None)
    rep["shadow"] = _shadow_verdict(run, cfg)
    rep["forks"] = forks(run)
    rep["advice"] = _advice(rep, serious, cfg)
    rep["culprit"] = culprit(rep, serious)
    rep["blame"] = blame(rep, serious)
    rep["verdict"] = _verdict(rep, serious)
    return rep


def culprit(rep: dict, serious: pd.DataFrame) -> dict | None:
    """The tensor to look at first: where the trouble entered, not where it spread to.

    The NaN origin when it comes no later than the first anomaly; None when the optimizer side moved
    first (no tensor is to blame); otherwise the first warning-or-critical event that names a tensor
    (the first anomaly itself when it does). ``{layer, tensor, step, rule, severity}``."""
    nan, first = rep.get("nan_origin"), rep.get("first_anomaly")
    if nan is not None and (first is None or nan["step"] <= first["step"]):
        e = nan
    elif (rep.get("attribution") or {}).get("side") == "optimizer" or serious.empty or _only_simulated(rep, serious):
        return None
    elif first is not None and first["layer"]:
        e = first
    else:
        t = serious[(serious["layer"] != "") & serious["layer"].notna()].sort_values(["step", "rank"], kind="stable")
        if t.empty:
            return None
        e = _ev(t.iloc[0])
    return {k: e[k] for k in ("layer", "tensor", "step", "rule", "severity")}


def blame(rep: dict, serious: pd.DataFrame) -> dict:
    """Is FP8 to blame? ``level``: "clean", "likely", "symptoms", "unlikely" or "unknown", and ``why`` in one
    sentence.

    Evidence in order of strength: BF16 forks from the same state (a fork that recovers in BF16 says FP8;
    one that fails the same way says not FP8), a BF16 replica that also goes non-finite, which side moved
    first (the optimizer side before any FP8 symptom says not FP8), BF16 shadow compares departing from
    FP8's own usual error, and FP8 symptoms (saturation, underflow, mismatched scales, NaN) first. An FP8
    symptom first whose loss then did not move ("symptoms", ``rep["harm"]``, :mod:`fp8scope.detect.harm`)
    blames FP8 for nothing yet: it says where FP8 loses precision, not why training failed. A non-finite
    tensor is harm by itself."""
    if not rep.get("steps"):
        return {"level": "unknown", "why": "no statistics logged yet"}
    done = [f for f in rep.get("forks") or [] if f["verdict"] in ("fp8-induced", "not-fp8")]
    fp8_forks = [f for f in done if f["verdict"] == "fp8-induced"]
    if fp8_forks:
        f = fp8_forks[0]
        return {"level": "likely", "why": f"a BF16 fork from step {f['start_step']} from the same state recovered "
                                          f"while FP8 did not ({f['reason']})"}
    if done:
        f = done[0]
        return {"level": "unlikely", "why": f"a BF16 fork from step {f['start_step']} failed the same way ({f['reason']})"}
    sh = rep.get("shadow") or {}
    if (sh.get("loss") or {}).get("bf16_nonfinite"):
        return {"level": "unlikely", "why": "the BF16 replica from the same state also went non-finite"}
    cov = f" in the monitored layers ({rep['coverage']})" if rep.get("coverage") else ""
    if serious.empty:
        return {"level": "clean", "why": "no warning or critical events" + cov}
    if _only_simulated(rep, serious):
        return {"level": "clean", "why": f"no warning or critical events in training{cov}; the only ones are what-if, on "
                                         f"layers that ran in high precision ({_some(serious['layer'])}), whose casts "
                                         "are simulated"}
    att = rep.get("attribution") or {}
    if att.get("side") == "optimizer":
        e, x = att["event"], att["fp8_event"]
        return {"level": "unlikely", "why": f"the optimizer side moved first ({e['rule']} at step {e['step']}"
                + (f", FP8's first symptom only {_when(e, x)})" if x else ", no FP8 symptom at all)")}
    if (rep.get("measured") or {}).get("kind") == "whatif":
        return {"level": "unknown", "why": "what-if run: training ran in high precision, the FP8 symptoms are "
                                           "simulated (they say what FP8 would have done)"}
    if sh.get("layers_over_threshold"):
        w = sh["worst_layers"][0]
        return {"level": "likely", "why": f"FP8 departs from a BF16 shadow beyond its own usual error, worst in "
                                          f"{w['layer']} ({_short(w['max_departure'])}x)"}
    if att.get("side") == "fp8" and att["event"]["rule"] in NON_FINITE and rep.get("nan_upstream"):
        e = rep["nan_origin"]
        return {"level": "unknown", "why": f"the first NaN reached {e['layer']} {e['tensor']} at step {e['step']} after "
                                           f"{_some(rep['nan_upstream'])}, which fp8scope did not monitor: it may have "
                                           "started there"}
    if att.get("side") == "fp8":
        e = att["event"]
        surge = att.get("surge")
        if surge:
            return {"level": "unknown", "why": f"the gradients surged at step {e['step']}: {len(surge)} layers' gradients "
                                               f"clipped or spiked at once ({_some(surge)}) with no forward tensor "
                                               "flagged before them. A surge comes from the backward (the loss, the "
                                               "model's dynamics) and FP8 clipped it; a BF16 fork from before it "
                                               "(fp8scope.Shadow) tells whether the clipping made it worse"}
        what = f"{e['rule']} in {e['layer']} {e['tensor']} at step {e['step']}"
        h = rep.get("harm")
        if h is not None and h["hurt"] is False and e["rule"] not in NON_FINITE:
            return {"level": "symptoms", "why": f"an FP8 symptom came first ({what}, {e['severity']}), and {h['how']}: "
                                              "nothing to blame on FP8 yet. A BF16 fork from before it "
                                              "(fp8scope.Shadow) tells what the symptom costs"}
        return {"level": "likely", "why": f"an FP8 symptom came first: {what}" + (f", and {h['how']}" if h else "")}
    # no FP8 symptom on a layer that ran FP8 (attribution found none): any left are simulated
    simulated = _simulated(rep, serious)
    if not simulated.empty:
        return {"level": "unlikely", "why": "FP8's only symptoms are simulated, on layers that ran in high precision "
                                            f"(what-if): {_some(simulated['layer'])}"}
    return {"level": "unknown", "why": "warnings without an FP8 symptom or an optimizer-side event to order them"}


SURGE_LAYERS = 3  # layers whose gradients clip or spike at one step: a surge from the backward, not one cast


def _gradient_surge(serious: pd.DataFrame, first: dict, whatif=()) -> list[str]:
    """The layers whose gradients clipped (``saturation``) or jumped (``amax_spike``) at the step of
    ``first``, the first FP8 symptom, when it is a gradient's clip, at least ``SURGE_LAYERS`` layers
    share it, and no forward tensor of that rank was flagged up to that step (a what-if layer's
    simulated cast is no flag: ``whatif``, as in :func:`attribution`); else []. Such a step
    is a surge: the gradients of many layers grew by 10x-1000x at once, which their delayed scales
    could not follow. It comes from the backward, not from one layer's cast. A clean BART (lr 3e-3) did
    that at step 75 in emulated FP8, and at step 62 in high precision. Its loss spiked two steps
    later, and BF16 forks from the same state spiked the same way ("not-fp8"), so "FP8 is the likely
    cause" was wrong."""
    if first.get("rule") != "saturation" or base_role(str(first.get("tensor") or "")) != "gradient":
        return []
    mine = serious[(serious["rank"] == first["rank"]) & (serious["layer"] != "") & serious["layer"].notna()
                   & ~(serious["layer"].isin(list(whatif)) & serious["rule"].isin(SIMULATED_CAST))]
    roles = mine["tensor"].astype(str).map(base_role)
    if ((roles != "gradient") & (mine["step"] <= first["step"])).any():
        return []
    at = mine[(mine["step"] == first["step"]) & (roles == "gradient") & mine["rule"].isin(("saturation", "amax_spike"))]
    layers = sorted(set(at["layer"]))
    return layers if len(layers) >= SURGE_LAYERS else []


BLAME_TITLES = {"clean": "No problems flagged", "likely": "FP8 is the likely cause",
                "symptoms": "FP8 symptoms, no harm seen in the loss",
                "unlikely": "FP8 is unlikely the cause", "unknown": "FP8's part is unknown"}


def blame_text(rep: dict) -> str:
    """The verdict in one line: the same words in the CLI, the HTML report and the dashboard's card."""
    b = rep["blame"]
    return f"{BLAME_TITLES[b['level']]}: {b['why']}"


def culprit_text(rep: dict) -> str:
    c = rep.get("culprit")
    if c is None:
        return "none (no tensor to blame)" if (rep.get("attribution") or {}).get("side") == "optimizer" else "none"
    return f"{c['layer']} {c['tensor']} at step {c['step']} ({c['rule']})"


def _planted(meta: dict) -> list[str]:
    """The failures the demo planted (``fp8scope.demo`` marks its runs); a user's own ``meta["inject"]``
    is the user's business, not a plant."""
    if meta.get("planted_by") != "fp8scope.demo":
        return []
    specs = meta.get("inject") or []
    return [specs] if isinstance(specs, str) else [str(s) for s in specs if isinstance(s, str)]


def _top_layers(serious: pd.DataFrame, whatif: list[str] | tuple = (), n: int = 5) -> list[dict]:
    """The (layer, tensor) pairs with the most severe events, worst first, each marked ``"whatif": True``
    when it is one of ``whatif``, a mixed run's high-precision layers, whose FP8 events are simulated
    (their amax is real: an outlier may enter there). Plain python over the event records: a pandas
    group-by with a sort, a value_counts and a drop_duplicates per pair cost seconds on a run with
    hundreds of flagged tensors."""
    t = serious[(serious["layer"] != "") & serious["layer"].notna() & serious["tensor"].notna()] \
        if not serious.empty else serious
    groups: dict[tuple, list[dict]] = {}
    for r in t.to_dict("records"):
        groups.setdefault((r["layer"], r["tensor"]), []).append(r)
    out = [_layer_summary(layer, tensor, sorted(rs, key=lambda r: r["step"])) for (layer, tensor), rs in groups.items()]
    simulated = set(whatif)
    for d in out:
        d["whatif"] = d["layer"] in simulated
    out.sort(key=lambda d: (-d["_score"][0], -d["_score"][1], -d["_score"][2]))
    for d in out:
        d.pop("_score")
    return out[:n]


def _layer_summary(layer: str, tensor: str, rs: list[dict]) -> dict:
    """One top-layer entry from its events in step order: rules by count (ties: first seen first, as
    pandas' value_counts), the first message of each of the first 4 rules as evidence."""
    worst = max(SEVERITY_RANK[r["severity"]] for r in rs)
    counts: dict[str, int] = {}
    first_msg: dict[str, str] = {}
    for r in rs:
        counts[r["rule"]] = counts.get(r["rule"], 0) + 1
        first_msg.setdefault(r["rule"], r["message"])
    return {
        "layer": layer, "tensor": tensor, "first_step": int(rs[0]["step"]), "events": len(rs),
        "worst": ("info", "warning", "critical")[worst],
        "rules": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        "evidence": list(first_msg.values())[:4],
        "_score": (worst, -int(rs[0]["step"]), len(rs)),
    }


def _scalar_frame(run, cfg: DetectConfig) -> pd.DataFrame | None:
    """step, name, value of the loss and the grad norm (the mean over ranks); None when the run logs no scalars."""
    if "scalars" not in run.table_names():
        return None
    return _mean_per_step(run.table("scalars"), [cfg.loss_name, cfg.grad_norm_name])


def _series(df: pd.DataFrame | None, name: str) -> pd.DataFrame | None:
    return None if df is None else df[df["name"] == name][["step", "value"]]


def _scalar_context(df: pd.DataFrame | None, cfg: DetectConfig, first: dict | None) -> dict:
    if df is None:
        return {}
    out: dict[str, Any] = {}
    for name in (cfg.loss_name, cfg.grad_norm_name):
        s = df[df["name"] == name].sort_values("step")
        if s.empty:
            continue
        v = s["value"].astype(float)
        finite = s[v.map(math.isfinite)]
        d: dict[str, Any] = {
            "first": _clean(float(v.iloc[0])), "last": _clean(float(v.iloc[-1])),
            "min": _clean(float(finite["value"].min())) if not finite.empty else None,
            "max": _clean(float(finite["value"].max())) if not finite.empty else None,
        }
        bad = s[~v.map(math.isfinite)]
        d["first_nonfinite_step"] = int(bad["step"].iloc[0]) if not bad.empty else None
        if first is not None:
            before = finite[(finite["step"] < first["step"]) & (finite["step"] >= first["step"] - 10)]
            at = s[s["step"] >= first["step"]].head(1)
            d["mean_10_before_first_anomaly"] = _clean(float(before["value"].mean())) if not before.empty else None
            d["at_first_anomaly"] = _clean(float(at["value"].iloc[0])) if not at.empty else None
            after = finite[finite["step"] > first["step"]]
            d["max_after_first_anomaly"] = _clean(float(after["value"].max())) if not after.empty else None
        out[name] = d
    return out


def _mean_per_step(t, names: list[str]) -> pd.DataFrame:
    """step, name, value: the mean over ranks of the named scalars at each step. In Arrow, not SQL:
    importing DuckDB and registering the run's tables cost more than this aggregate over a 10k-step run."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = t.combine_chunks()  # a zero-copy read has a chunk of a few rows per logged step: per-chunk costs dominate
    t = t.filter(pc.is_in(t["name"], value_set=pa.array(names, pa.string())))
    g = t.group_by(["step", "name"]).aggregate([("value", "mean")])
    return g.rename_columns({"value_mean": "value"}).select(["step", "name", "value"]).to_pandas()


def forks(run) -> list[dict]:
    """Every BF16 fork of the run (``shadow_fork``: the row of its last step holds the verdict): id,
    trigger, steps, verdict, reason, final losses. Empty when the run has none."""
    if "shadow_fork" not in set(run.table_names()):
        return []
    t = run.table("shadow_fork").to_pandas()
    if t.empty or "fork_id" not in t.columns:
        return []
    out = []
    for fid, g in t.sort_values(["fork_id", "step"], kind="stable").groupby("fork_id", sort=True):
        last = g.iloc[-1]
        out.append({"fork_id": int(fid), "trigger": str(last.get("trigger") or ""), "start_step": int(last["start_step"]),
                    "last_step": int(last["step"]), "verdict": str(last["verdict"]), "reason": str(last.get("reason") or ""),
                    "loss_fp8": _clean(float(last["loss_fp8"])), "loss_bf16": _clean(float(last["loss_bf16"])),
                    "baseline": _clean(float(last["baseline"]))})
    return out


def _shadow_verdict(run, cfg: DetectConfig) -> dict | None:
    from fp8scope.detect.shadow_rule import departures

    names = set(run.table_names())
    if "shadow_compare" not in names:
        return None
    d = departures(run.table("shadow_compare"), cfg)
    if d.empty:
        return None
    judged = d[d["baseline"].notna()]
    # where FP8 hurts: layers ranked by their worst departure from their own baseline, not by raw error
    per_layer = (judged.groupby("layer").agg(max_departure=("departure", "max"), max_rel_err=("err", "max"),
                                             baseline=("baseline", "median"), departs=("departs", "sum"))
                 .sort_values("max_departure", ascending=False)) if not judged.empty else pd.DataFrame()
    over = per_layer[per_layer["departs"] > 0] if not per_layer.empty else per_layer
    out: dict[str, Any] = {
        "steps_compared": int(d["step"].nunique()),
        "baseline_steps": sorted(int(x) for x in d.loc[d["baseline"].isna(), "step"].unique()),
        "factor": cfg.shadow_factor,
        "worst_layers": [{"layer": k, "max_departure": _clean(float(r["max_departure"])),
                          "max_rel_err": _clean(float(r["max_rel_err"])), "baseline_rel_err": _clean(float(r["baseline"]))}
                         for k, r in per_layer.head(5).iterrows()],
        "layers_over_threshold": over.index.tolist(),
    }
    loss_note = None
    if "shadow_loss" in names:
        sl = run.table("shadow_loss").to_pandas()
        num = [c for c in sl.columns if c not in ("step", "rank", "segment", "time") and pd.api.types.is_numeric_dtype(sl[c])]
        out["shadow_loss_columns"] = num
        fp8c = next((c for c in num if "fp8" in c), None)
        bf16c = next((c for c in num if "bf16" in c or "ref" in c or "shadow" in c), None)
        if fp8c and bf16c and not sl.empty:
            f = sl[fp8c].astype(float)
            b = sl[bf16c].astype(float)
            fp8_bad = bool((~f.map(math.isfinite)).any())
            bf16_bad = bool((~b.map(math.isfinite)).any())
            loss_note = {"fp8_nonfinite": fp8_bad, "bf16_nonfinite": bf16_bad,
                         "max_abs_diff": _clean(float((f - b).abs().max()))}
    out["loss"] = loss_note
    if loss_note and loss_note["bf16_nonfinite"]:
        out["verdict"] = "BF16 from the same state also blows up: FP8 is probably NOT to blame (look at lr, data, optimizer)."
    elif judged.empty:
        out["verdict"] = "too few compares per layer to judge FP8 against its own baseline yet"
    elif over.empty:
        out["verdict"] = (f"FP8 stays within {cfg.shadow_factor:g}x its own usual distance from BF16 in every compared "
                          "layer: FP8 is probably not to blame.")
    else:
        w = per_layer.iloc[0]
        out["verdict"] = (f"FP8 departs from BF16 by more than {cfg.shadow_factor:g}x its usual error in {len(over)} "
                          f"layer(s), worst {over.index[0]} ({_short(w['max_departure'])}x its usual "
                          f"{_short(100 * w['baseline'])}%): FP8 hurts there.")
    return out


# What FP8 does to tensors (the damage FP8 can cause, and a growing outlier that leads there), and what the
# optimizer side shows.
FP8_DAMAGE = frozenset({"saturation", "saturation_rate", "underflow", "nan_origin", "nonfinite", "stale_scale",
                        "scale_mismatch", "scale_kept", "scale_collapse", "fp8_vs_bf16", "amax_trend",
                        "format_mismatch"})
OPTIMIZER_SIDE = frozenset({"lr_change", "loss_spike", "grad_norm_spike"})


def whatif_layers(manifest: dict) -> list[str]:
    """The layers kept in high precision in a run whose other layers ran FP8 (run.json's tensors,
    ``schema.simulated_casts``): their FP8 symptoms are simulated; empty in any other run."""
    ts = manifest.get("tensors") or []
    return sorted({t["layer"] for t, sim in zip(ts, simulated_casts(t.get("source") for t in ts)) if sim})


NON_FINITE = frozenset({"nan_origin", "nonfinite"})


def unmonitored_upstream(manifest: dict, event: dict | None) -> list[str]:
    """The modules the monitor left (``meta.coverage``) that ``event``'s values may have passed
    through just before they reached its tensor: those between its layer and the monitored layer
    before it in the model's module order for a forward tensor (an activation or output), and
    between it and the monitored layer after it for a gradient (the backward runs the model in
    reverse). A Mixtral's experts sit between one layer's ``o_proj`` and the next layer's
    ``q_proj``, so a NaN they make is first seen at that ``q_proj``'s input. Module order stands in
    for the data flow, which a module list does not record: [] for a weight, or where the run
    does not say."""
    cov = coverage_of(manifest)
    order = [str(n) for n in cov.get("order") or []]
    left = {str(u.get("module")) for u in cov.get("unmonitored") or [] if isinstance(u, dict)}
    if not event or not left or event.get("layer") not in order:
        return []
    i = order.index(event["layer"])
    role = base_role(str(event.get("tensor") or ""))
    if role in ("activation", "output"):
        j = max((k for k in range(i) if order[k] not in left), default=-1)
        return [n for n in order[j + 1:i] if n in left]
    if role == "gradient":
        j = min((k for k in range(i + 1, len(order)) if order[k] not in left), default=len(order))
        return [n for n in order[i + 1:j] if n in left]
    return []


def _simulated(rep: dict, serious: pd.DataFrame) -> pd.DataFrame:
    """The events on the layers of ``rep["whatif_layers"]``, whose FP8 casts are simulated."""
    return serious[serious["layer"].isin(rep.get("whatif_layers") or [])]


def _only_simulated(rep: dict, serious: pd.DataFrame) -> bool:
    """Whether every warning or critical event judges a simulated cast (``engine.SIMULATED_CAST``) of a
    layer that ran in high precision: training itself went without one."""
    simulated = _simulated(rep, serious)
    return not serious.empty and len(simulated) == len(serious) and bool(simulated["rule"].isin(SIMULATED_CAST).all())


def _some(layers) -> str:
    """Up to three distinct layer names, in order, for a sentence."""
    ls = list(dict.fromkeys(layers))
    return ", ".join(ls[:3]) + (" and others" if len(ls) > 3 else "")


def layer_recipes(manifest: dict) -> dict[str, str]:
    """Each FP8 layer's recipe kind (run.json's tensors), in a run whose FP8 layers train under more than
    one (nested ``fp8_autocast`` regions: NVFP4 with its last layers in MXFP8); empty otherwise, where
    the run's recipe is every layer's."""
    kinds = {t["layer"]: t["recipe"] for t in manifest.get("tensors") or []
             if t.get("source") != "whatif" and isinstance(t.get("recipe"), str)}
    return kinds if len(set(kinds.values())) > 1 else {}


def _phases(ev: pd.DataFrame) -> pd.Series:
    """When each event happens within its step: an FP8 symptom in the forward (0), the loss (1), an FP8
    symptom in the backward (2: a gradient, a weight gradient's BF16 compare), the grad norm and the lr
    the optimizer applies (3)."""
    # "wgrad": a BF16 compare of the weight gradient (fp8_vs_bf16)
    grad = ev["tensor"].astype(str).map(base_role).isin(("gradient", "wgrad"))
    opt = ev["rule"].isin(OPTIMIZER_SIDE)
    return pd.Series(np.where(opt, np.where(ev["rule"] == "loss_spike", 1, 3), np.where(grad, 2, 0)), index=ev.index)


def _when(e: dict, x: dict) -> str:
    """Where FP8's first symptom ``x`` comes after the optimizer-side event ``e``: a later step, or the
    backward of the step whose loss spiked."""
    return f"in the backward of step {x['step']}" if x["step"] == e["step"] else f"at step {x['step']}"


def attribution(serious: pd.DataFrame, whatif: list[str] | tuple = ()) -> dict:
    """Which side moved first. An lr change, loss spike or grad-norm spike before any FP8 saturation,
    underflow, stale or mismatched scale, NaN or BF16 departure points away from FP8. Within a step the
    forward's tensors come before its loss, and its gradients after it (:func:`_phases`): a loss spike
    is not the effect of the same step's gradients, which change only the next step's weights; a
    step's grad norm and applied lr come after all its tensors. ``whatif``: layers that ran in high
    precision in a run whose others ran FP8; their simulated symptoms are no FP8 damage. ``side``:
    "optimizer", "fp8" or None; ``event``: the first event of that side; ``fp8_event``: the first FP8
    one, if any; ``surge`` (side "fp8"): the layers of a gradient surge that event is part of
    (:func:`_gradient_surge`), which the verdict and the advice read."""
    if serious.empty:
        return {"side": None, "event": None, "fp8_event": None}
    ordered = serious.assign(_phase=_phases(serious)).sort_values(["step", "_phase", "rank"], kind="stable")
    opt = ordered[ordered["rule"].isin(OPTIMIZER_SIDE)]
    fp8 = ordered[ordered["rule"].isin(FP8_DAMAGE) & ~ordered["layer"].isin(list(whatif))]
    first_opt = _ev(opt.iloc[0]) if not opt.empty else None
    first_fp8 = _ev(fp8.iloc[0]) if not fp8.empty else None
    if first_opt is not None and (first_fp8 is None or (opt["step"].iloc[0], opt["_phase"].iloc[0])
                                  < (fp8["step"].iloc[0], fp8["_phase"].iloc[0])):
        return {"side": "optimizer", "event": first_opt, "fp8_event": first_fp8}
    if first_fp8 is not None:
        return {"side": "fp8", "event": first_fp8, "fp8_event": first_fp8,
                "surge": _gradient_surge(serious, first_fp8, whatif)}
    return {"side": None, "event": None, "fp8_event": None}


def _optimizer_advice(rep: dict) -> list[str]:
    a = rep["attribution"]
    e, f = a["event"], a["fp8_event"]
    after = (f"; FP8 trouble only follows {_when(e, f)} ({f['rule']} in {f['layer']} {f['tensor']})" if f
             else "; no FP8 saturation, underflow or NaN at all")
    if e["rule"] == "lr_change":
        first = (f"The learning rate changed abruptly at step {e['step']} ({e['message']}){after}. Check the "
                 "schedule and the optimizer / scheduler state (a resumed scheduler, a wrong lr multiplier); changing "
                 "the FP8 recipe will not fix it.")
    else:
        what = "loss" if e["rule"] == "loss_spike" else "grad norm"
        first = (f"The {what} spiked at step {e['step']} before any FP8 symptom{after}. Look at the batch of that "
                 "step and at the learning rate; confirm with a BF16 shadow fork that BF16 does the same.")
    return [first]


def _advice(rep: dict, serious: pd.DataFrame, cfg: DetectConfig) -> list[str]:
    if serious.empty:
        return ["Nothing at warning level or above: the FP8 numerics look healthy with these thresholds."]
    simulated = _simulated(rep, serious)
    if simulated.empty:
        return _rule_advice(rep, serious, cfg)
    note = (f"{_some(simulated['layer'])} ran in high precision (measured what-if): the FP8 events there say what "
            "the what-if recipe would do to them, not what training did; keep them out of FP8.")
    rest = serious.drop(simulated.index)
    return [note] + (_rule_advice(rep, rest, cfg) if not rest.empty else [])


def _rule_advice(rep: dict, serious: pd.DataFrame, cfg: DetectConfig) -> list[str]:
    if rep.get("attribution", {}).get("side") == "optimizer":
        return _optimizer_advice(rep)
    # the recipe whose numbers the events judge: the model's, or in a what-if run the what-if recipe's
    recipe = rep.get("recipe") or (rep.get("measured") or {}).get("whatif_recipe") or {}
    delayed = recipe.get("kind") == "delayed"
    hist = recipe.get("amax_history_len")
    margin = recipe.get("margin", 0)
    rules = set(serious["rule"])
    adv: list[str] = []
    kinds = rep.get("layer_recipes") or {}

    def kind_of(ls):  # the recipe kind of the first flagged layer: its own in a run of several recipes
        return (kinds.get(ls[0]) if ls else None) or recipe.get("kind")

    def layers_of(*names):
        s = serious[serious["rule"].isin(names) & (serious["layer"] != "")]
        return list(dict.fromkeys(s["layer"]))[:3]

    if "nan_origin" in rules:
        o = rep["nan_origin"]
        up = rep.get("nan_upstream")
        if up:
            adv.append(f"NaN origin: {o['layer']} {o['tensor']} at step {o['step']} is the first monitored tensor the NaN "
                       f"reached; {_some(up)} ran just before it and fp8scope did not monitor them: look at their outputs "
                       f"at step {o['step']} first.")
        else:
            adv.append(f"NaN origin: {o['layer']} {o['tensor']} at step {o['step']}. Inspect that layer's input at that "
                       f"step; keep {o['layer']} in BF16 for one run to tell FP8 from the model (if it still NaNs, FP8 "
                       "is not to blame).")
    att = rep.get("attribution") or {}
    surge = att.get("surge")
    if surge:  # not an outlier to keep in BF16: the gradients of many layers jumped at once (blame says so)
        adv.append(f"The gradients surged at step {att['event']['step']} in {len(surge)} layers ({_some(surge)}): their delayed "
                   "scales could not follow a 10x-1000x jump in one step, so FP8 clipped them. The surge comes from the "
                   "backward: look at that step's loss, batch and lr. A BF16 fork from before it (fp8scope.Shadow, "
                   "forks on events) tells whether the clipping made it worse; current scaling follows such a jump at "
                   "once.")
    elif rules & {"amax_spike", "saturation"}:
        ls = layers_of("amax_spike", "saturation")
        tip = ((f"raise margin (now {margin}) by 1-2 binades" if delayed else "raise its margin by 1-2 binades")
               if kind_of(ls) == "delayed" else "check the data feeding it")
        adv.append(f"Outlier saturates FP8 in {', '.join(ls)}: keep {ls[0]} in BF16 (fp8_skip), or {tip}, "
                   "or use current (per-tensor dynamic) scaling for it. For an MLP down-projection input, "
                   "Smooth-SwiGLU tames growing outliers.")
    if "stale_scale" in rules and kind_of(layers_of("stale_scale")) == "delayed":
        now = f"now {hist}; " if delayed and hist else ""
        adv.append(f"Stale scale after a spike: shorten amax_history_len ({now}16-32 recovers in as many steps) "
                   "or use amax_compute_algo='most_recent'. Compare choices on this run: "
                   f"fp8scope whatif {rep['run']} --compare \"delayed:{hist or 1024}:{margin},delayed:16:1,current\"")
    if "saturation_rate" in rules:
        adv.append("Saturation most steps: the amax keeps outgrowing the history; raise margin by 1 or shorten "
                   "amax_history_len.")
    if "underflow" in rules:
        ls = layers_of("underflow")
        g = serious[(serious["rule"] == "underflow") & (serious["tensor"].map(base_role) == "gradient")]
        if not g.empty:
            adv.append(f"Gradients underflow E5M2 in {', '.join(ls)}: check loss / gradient scaling; current scaling "
                       "for gradients adapts at once; or keep those layers in BF16.")
        elif not set(ls) <= set(layers_of("scale_mismatch", "stale_scale")):
            adv.append(f"Values underflow in {', '.join(ls)}: the scale is set by a few large values; "
                       "per-channel / block scaling (MXFP8) or BF16 for those layers.")
    if "scale_mismatch" in rules:
        ls = layers_of("scale_mismatch")
        adv.append(f"The scale of {', '.join(ls)} comes from an amax those tensors never had: a scale reset (a checkpoint "
                   "resumed without the FP8 scaling state: TE keeps it in the module's extra state / fp8_meta), or a "
                   "corrupted or foreign amax history. Restore the recipe state with the checkpoint; until the history "
                   "refills, small values flush to zero.")
    if "amax_trend" in rules:
        ls = layers_of("amax_trend")
        kind = kind_of(ls)
        tame = "tame it (Smooth-SwiGLU for an MLP down-projection input) or keep the layer in BF16"
        if kind in BLOCK_SCALED:
            adv.append(f"A growing outlier in {', '.join(ls)}: it climbs away from its peers. The {kind} "
                       "block scales confine it to the blocks that hold it, so FP8 loses little while those blocks "
                       f"do not underflow (an underflow warning says when they do). If it keeps growing, {tame}.")
        else:
            if kind == "delayed":
                fate = ("will saturate once it outruns the amax history, and the scale it sets flushes the rest of the "
                        "tensor to zero. Per-tensor current scaling stops the saturation but not the flush; block")
            else:
                fate = "sets the scale, so the rest of the tensor flushes to zero as it grows. Block"
            adv.append(f"A growing outlier in {', '.join(ls)}: it climbs away from its peers and {fate} scaling (MXFP8, "
                       f"Float8BlockScaling) confines it to the blocks that hold it. Or {tame}.")
    if "format_mismatch" in rules:
        ls = layers_of("format_mismatch")
        adv.append(f"{', '.join(ls)} cast(s) a tensor to another FP8 format than the rest of the model (a gradient in "
                   "E4M3 loses 14 binades of range next to E5M2): give every layer the same recipe (HYBRID: E4M3 "
                   "forward, E5M2 gradients) and look for the per-layer override that set it.")
    if "scale_collapse" in rules:
        adv.append("Scale collapsing (scale_inv rising step after step): the run fights growing values; "
                   "lower the learning rate or add warm-up, then check which layer grows first.")
    if "scale_kept" in rules:
        adv.append("A NaN/Inf amax was silently ignored by the recipe (old scale kept): treat the NaN, not the scale.")
    if "layer_outlier" in rules:
        ls = layers_of("layer_outlier")
        adv.append(f"Layer(s) far outside their peers: {', '.join(ls)}. Candidates to keep in BF16.")
    fp8_rules = rules - {"loss_spike", "grad_norm_spike", "loss_nonfinite"}
    if rules & {"loss_spike", "grad_norm_spike", "loss_nonfinite"} and not fp8_rules:
        adv.append("Loss / grad-norm spiked with no FP8 warning before it: likely not FP8 (learning rate, data, "
                   "optimizer). Confirm with a BF16 shadow run (fp8scope shadow steps).")
    if "fp8_vs_bf16" in rules:
        ls = layers_of("fp8_vs_bf16")
        adv.append(f"FP8 departs from BF16 well beyond its own usual error in {', '.join(ls)}: keep those in BF16.")
    return adv


def _verdict(rep: dict, serious: pd.DataFrame) -> str:
    if not rep.get("steps"):
        return "no statistics logged yet"
    if serious.empty:
        return "clean: no warning or critical events"
    f = rep["first_anomaly"]
    where = f"{f['layer']} {f['tensor']}".strip() if f["layer"] else f["tensor"]
    s = f"first anomaly at step {f['step']}: {f['rule']} in {where}"
    att = rep.get("attribution") or {}
    if att.get("side") == "optimizer":
        e, x = att["event"], att["fp8_event"]
        s += (f"; the optimizer side moved first ({e['rule']} at step {e['step']}, "
              + (f"before FP8's first symptom {_when(e, x)}" if x else "with no FP8 symptom") + "): FP8 is unlikely "
              "the cause")
    if (rep.get("measured") or {}).get("kind") == "whatif" and f["layer"]:
        s += " (what-if: simulated FP8; training ran in high precision)"
    elif f["layer"] in (rep.get("whatif_layers") or []) and f["rule"] in SIMULATED_CAST:
        s += " (what-if: simulated; the layer ran in high precision)"
    if rep["nan_origin"]:
        o = rep["nan_origin"]
        s += f"; NaN origin {o['layer']} {o['tensor']} at step {o['step']}"
    done = [f for f in rep.get("forks") or [] if f["verdict"] != "pending"]
    if done:
        s += "; BF16 forks: " + ", ".join(f"{f['verdict']} (from step {f['start_step']})" for f in done)
    if rep.get("shadow") and rep["shadow"].get("verdict"):
        s += f"; shadow: {rep['shadow']['verdict']}"
    return s


def _short(v) -> str:
    return f"{float(v):.3g}"


def short_value(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ---- HTML ------------------------------------------------------------------------------------
def render_html(rep: dict, run, events: pd.DataFrame, path, max_steps: int = 400, max_tensors: int = 4) -> None:
    import plotly.io as pio

    from fp8scope import figures

    e = html.escape
    serious = events[events["severity"].map(SEVERITY_RANK).fillna(0) >= WARN] if not events.empty else events
    figs = []
    hm_tensor = rep["first_anomaly"]["tensor"] if rep.get("first_anomaly") and rep["first_anomaly"]["layer"] else "activation"
    frame = figures.heatmap_frame(run, "log2_amax", tensor=hm_tensor, max_steps=max_steps)
    flagged = serious[serious["tensor"] == hm_tensor] if not serious.empty else None
    figs.append(("Heatmap", figures.heatmap(frame, "log2_amax", flagged=flagged,
                                            title=f"log2 amax per layer and step ({hm_tensor}); x = events")))
    frame = figures.heatmap_frame(run, "amax_over_range", tensor=hm_tensor, max_steps=max_steps)
    figs.append(("Saturation", figures.heatmap(frame, "amax_over_range", flagged=flagged,
                                               title=f"amax / representable range ({hm_tensor}); > 1 = clipped")))
    for d in rep["top_layers"][:max_tensors]:
        if base_role(d["tensor"]) not in ROLES:
            continue
        tf = figures.tensor_range_frame(run, d["layer"], d["tensor"])
        evs = serious[(serious["layer"] == d["layer"]) & (serious["tensor"] == d["tensor"])]
        figs.append((f"{d['layer']} {d['tensor']}", figures.amax_vs_range(tf, d["layer"], d["tensor"], events=evs)))
    sf = figures.scalars_frame(run)
    if not sf.empty:
        figs.append(("Loss and grad norm", figures.scalars_with_events(sf, serious)))
    parts = []
    for i, (name, fig) in enumerate(figs):
        parts.append(f"<h3>{e(name)}</h3>")
        parts.append(pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_width="100%"))

    def li(items):
        return "".join(f"<li>{e(str(x))}</li>" for x in items)

    top = "".join(
        f"<tr><td>{e(d['layer'])}</td><td>{e(d['tensor'])}{' (what-if: simulated)' if d.get('whatif') else ''}</td>"
        f"<td>{e(d['worst'])}</td><td>{d['first_step']}</td>"
        f"<td>{e(', '.join(f'{k} x{v}' for k, v in d['rules'].items()))}</td><td><ul>{li(d['evidence'])}</ul></td></tr>"
        for d in rep["top_layers"])
    ev_rows = "".join(
        f"<tr class='{e(r['severity'])}'><td>{int(r['step'])}</td><td>{int(r['rank'])}</td><td>{e(r['severity'])}</td>"
        f"<td>{e(r['rule'])}</td><td>{e(r['layer'])}</td><td>{e(r['tensor'])}</td><td>{e(r['message'])}</td></tr>"
        for r in serious.head(200).to_dict("records")) if not serious.empty else ""
    fa, no = rep.get("first_anomaly"), rep.get("nan_origin")
    sc = "".join(f"<li>{e(k)}: {e(', '.join(f'{a}={short_value(b)}' for a, b in v.items() if b is not None))}</li>"
                 for k, v in (rep.get("scalars") or {}).items())
    shadow = f"<h2>FP8 vs BF16</h2><p>{e(rep['shadow']['verdict'])}</p>" if rep.get("shadow") else ""
    if rep.get("forks"):
        shadow += ("<h2>BF16 forks</h2><table><tr><th>fork</th><th>trigger</th><th>steps</th><th>verdict</th>"
                   "<th>evidence</th></tr>" + "".join(
                       f"<tr><td>{f['fork_id']}</td><td>{e(f['trigger'])}</td><td>{f['start_step']}..{f['last_step']}</td>"
                       f"<td>{e(f['verdict'])}</td><td>{e(f['reason'])}</td></tr>" for f in rep["forks"]) + "</table>")
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>fp8scope report: {e(rep['run'])}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px;vertical-align:top}} .critical td{{background:#fdd}}
.warning td{{background:#ffe9cc}} code{{background:#f4f4f4}}</style></head><body>
<h1>fp8scope report</h1>
<p><b>run</b> {e(rep['run'])}<br><b>steps</b> {rep['steps']} ({rep['first_step']}..{rep['last_step']}),
<b>tensors</b> {rep['tensors']}<br><b>measured</b> {e(describe_mode(rep['measured']))}{('<br><b>coverage</b> ' + e(rep['coverage'])) if rep.get('coverage') else ''}<br><b>recipe</b> {e(recipe_text(rep['recipe']))}{('<br><b>what-if recipe</b> ' + e(recipe_text(rep['measured']['whatif_recipe']))) if rep['measured']['whatif_recipe'] else ''}
{('<br><b>planted</b> ' + e(', '.join(rep['planted']))) if rep.get('planted') else ''}</p>
<h2>Verdict</h2><p><b>{e(blame_text(rep))}</b></p><p>{e(rep['verdict'])}</p>
<p><b>Culprit:</b> {e(culprit_text(rep))}</p>
<p><b>First anomaly:</b> {e(fa['message']) + ' (step ' + str(fa['step']) + ', ' + e(fa['rule']) + ')' if fa else 'none'}<br>
<b>NaN origin:</b> {e(no['layer'] + ' ' + no['tensor']) + ' at step ' + str(no['step']) if no else 'none'}</p>
<h2>What to try</h2><ul>{li(rep['advice'])}</ul>
<h2>Top layers</h2><table><tr><th>layer</th><th>tensor</th><th>worst</th><th>first step</th><th>rules</th><th>evidence</th></tr>{top}</table>
<h2>Loss / grad norm</h2><ul>{sc}</ul>
{shadow}
<h2>Figures</h2>
{''.join(parts)}
<h2>Events (warning and above, first 200)</h2>
<table><tr><th>step</th><th>rank</th><th>severity</th><th>rule</th><th>layer</th><th>tensor</th><th>message</th></tr>{ev_rows}</table>
</body></html>
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)
