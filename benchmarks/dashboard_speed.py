"""Dashboard speed on a big run: 10,000 steps x ~1,000 tensors (10M tensor rows).

    .venv/bin/python benchmarks/dashboard_speed.py [--steps 10000] [--layers 336] [--root /tmp/fp8scope-bench]
    .venv/bin/python benchmarks/dashboard_speed.py --browser [--demo RUN] ...   # + times in real Chromium
    .venv/bin/python benchmarks/dashboard_speed.py --recipes 7 ...   # + a recipes table: every full step x tensor x 7 recipes

With ``--browser`` it also starts the real dashboard server and times, in headless Chromium
(Playwright, Debian's /usr/bin/chromium), from navigation or click to the drawn figure or table:
Overview opened from the Runs list (cold: the server loads the run) and reloaded (revisit), drawn =
the loss figure and the verdict card are on screen; the card's analysis finishing; and each view
switch through the top bar, on the big run and on a demo run.

Generates the run (--reuse to keep an earlier one) with
RunWriter and record batches matching schema.TENSOR_SCHEMA, then times, server side, what
each dashboard callback does: build the page for a view (DuckDB aggregation + plotly figure)
and serialize it to the JSON Dash sends. Cold = first time after the run is loaded (no
aggregate cached), warm = again with the same run version. Also: first page (Runs list),
loading the run, a live refresh after 10 appended steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8scope.schema import EVENT_SCHEMA, SCALAR_SCHEMA, TENSOR_SCHEMA  # noqa: E402
from fp8scope.store.manifest import new_manifest, write_manifest  # noqa: E402
from fp8scope.store.writer import RunWriter  # noqa: E402

SUBLAYERS = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
ROLES = ("activation", "weight", "gradient")


def tensor_keys(n_layers: int):
    layers = [f"blocks.{i // 4}.{SUBLAYERS[i % 4]}" for i in range(n_layers)]
    keys = [(l, r) for l in layers for r in ROLES]
    return layers, keys


def step_batch(step: int, keys, rng, full: bool, spike_layer: int | None) -> pa.RecordBatch:
    n = len(keys)
    fmt = np.array(["e5m2" if r == "gradient" else "e4m3" for _, r in keys])
    fp8_max = np.where(fmt == "e5m2", 57344.0, 448.0)
    base = np.where(fmt == "e5m2", 1e-3, 2.0)
    amax = base * np.exp(rng.normal(0, 0.1, n))
    if spike_layer is not None:
        amax[spike_layer] *= 300.0
    scale_inv = base * 1.05 / fp8_max * 2 ** 0.5
    numel = np.full(n, 1 << 20, dtype=np.int64)
    def counts(p):
        c = rng.binomial(1 << 20, p, n).astype(np.int64)
        return pa.array(c) if full else pa.nulls(n, pa.int64())
    uf = rng.binomial(1 << 20, 2e-3, n).astype(np.int64)
    over = (rng.binomial(1 << 20, 1e-6, n) + (amax > fp8_max * scale_inv) * 5000).astype(np.int64)
    cols = {
        "step": pa.array(np.full(n, step, np.int64)),
        "rank": pa.array(np.zeros(n, np.int32)),
        "layer": pa.array([k[0] for k in keys], pa.string()),
        "tensor": pa.array([k[1] for k in keys], pa.string()),
        "order": pa.array(np.arange(n, dtype=np.int32)),
        "source": pa.array(["emulated"] * n, pa.string()),
        "fp8_format": pa.array(fmt.tolist(), pa.string()),
        "recipe": pa.array(["delayed"] * n, pa.string()),
        "full": pa.array(np.full(n, full)),
        "calls": pa.array(np.ones(n, np.int32)),
        "amax": pa.array(amax),
        "min_nonzero": pa.array(amax * 1e-6) if full else pa.nulls(n, pa.float64()),
        "scale": pa.array(1 / scale_inv),
        "scale_inv": pa.array(scale_inv),
        "expected_amax": pa.array(base * 1.05),
        "fp8_max": pa.array(fp8_max),
        "numel": pa.array(numel),
        "zeros": counts(1e-3),
        "nonfinite": pa.array(np.zeros(n, np.int64)) if full else pa.nulls(n, pa.int64()),
        "overflow": pa.array(over) if full else pa.nulls(n, pa.int64()),
        "underflow": pa.array(uf) if full else pa.nulls(n, pa.int64()),
        # a bulk pressed under flushes evenly below the threshold: 1/16 of it from 4+ binades under
        "underflow_deep": pa.array(rng.binomial(uf, 1 / 16).astype(np.int64)) if full else pa.nulls(n, pa.int64()),
        # and sits under the normal range several times over what it flushes
        "below_normal": pa.array(np.minimum(8 * uf, numel).astype(np.int64)) if full else pa.nulls(n, pa.int64()),
        "saturated": counts(1e-5),
        "qerr_mse": pa.array(amax * 1e-4) if full else pa.nulls(n, pa.float64()),
        "sqnr_db": pa.array(rng.normal(30, 1, n)) if full else pa.nulls(n, pa.float64()),
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in TENSOR_SCHEMA], schema=TENSOR_SCHEMA)


def recipe_rows(step: int, keys, rng, recipes: tuple[str, ...]) -> pa.RecordBatch:
    """One full step's ``recipes`` rows (``Monitor(whatif_recipes=...)``): every tensor under each recipe,
    through the writer thread's own ``step_records.recipe_batch``."""
    from fp8scope.step_payload import TensorKey
    from fp8scope.step_records import recipe_batch

    tk = [TensorKey(l, r, "emulated", "e4m3", 448.0, (1024, 1024)) for l, r in keys]
    n = len(keys) * len(recipes)
    numel = float(1 << 20)
    m = np.column_stack([np.full(n, numel), np.full(n, numel), rng.binomial(1 << 20, 1e-3, n), rng.binomial(1 << 20, 1e-6, n),
                         rng.binomial(1 << 20, 1e-5, n), rng.random(n) * 1e-3, np.full(n, numel), 0.5 + rng.random(n)])
    return recipe_batch(step, 0, m, [(k, r) for k in range(len(keys)) for r in recipes], tk)


def make_big_run(run_dir: Path, steps: int, n_layers: int, every: int = 10, close: bool = True, start: int = 0,
                 writer: RunWriter | None = None, recipes: tuple[str, ...] = ()) -> RunWriter | None:
    layers, keys = tensor_keys(n_layers)
    if writer is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        if start == 0:
            write_manifest(run_dir, new_manifest(
                recipe={"kind": "delayed", "amax_history_len": 16, "margin": 0, "fp8_format": "HYBRID"},
                tensors=[{"layer": l, "tensor": r, "shape": [1024, 1024], "fp8_format": "e4m3", "source": "emulated"}
                         for l, r in keys], meta={"model": "synthetic-bench"}))
        writer = RunWriter(run_dir, rank=0)
    rng = np.random.default_rng(start)
    spike = keys.index((layers[min(len(layers) - 1, 101)], "activation"))
    for s in range(start, start + steps):
        hit = spike if s % 1000 == 500 else None
        writer.write("tensors", step_batch(s, keys, rng, full=(s % every == 0), spike_layer=hit))
        if recipes and s % every == 0:
            writer.write("recipes", recipe_rows(s, keys, rng, recipes))
        loss = 4.0 * np.exp(-s / 3000) + 1.5 + rng.normal(0, 0.02)
        writer.write("scalars", pa.record_batch(
            [pa.array([s, s, s], pa.int64()), pa.array([0, 0, 0], pa.int32()),
             pa.array(["loss", "grad_norm", "lr"]), pa.array([loss, 0.5 + rng.random(), 3e-4]),
             pa.array([time.time()] * 3)], schema=SCALAR_SCHEMA))
        if hit is not None:
            l, r = keys[hit]
            writer.write("events", pa.record_batch(
                [pa.array([s], pa.int64()), pa.array([0], pa.int32()), pa.array(["amax_outlier"]),
                 pa.array(["warning"]), pa.array([l]), pa.array([r]), pa.array([600.0]), pa.array([448.0]),
                 pa.array([f"amax {600:.0f} above representable range"])], schema=EVENT_SCHEMA))
    if close:
        writer.close()
        return None
    return writer


def timed(fn, repeat: int = 1):
    best = None
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        d = time.perf_counter() - t
        best = d if best is None else min(best, d)
    return best, out


def payload(children) -> int:
    import plotly.io  # noqa: F401  (registers the encoder)
    from plotly.utils import PlotlyJSONEncoder

    return len(json.dumps(children, cls=PlotlyJSONEncoder))


VIEW_READY = {"overview": "#overview-scalars .main-svg", "heatmap": "#heatmap-graph .main-svg",
              "outliers": "#outliers-table", "tensor": "#tensor-amax .main-svg", "live": "#live-scalars .main-svg"}


def start_server(root: Path):
    """The real dashboard server on a free port, answering: (process, url)."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    srv = subprocess.Popen([sys.executable, "-m", "fp8scope", "dashboard", str(root), "--port", str(port)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return srv, url


def browser_times(root: Path, runs: list[str]) -> dict:
    """Seconds from navigation / click to drawn, per run and view, in headless Chromium."""
    from playwright.sync_api import sync_playwright

    srv, url = start_server(root)
    out: dict[str, float] = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless=new", "--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})

            def until(sel: str, timeout_s: float = 300) -> float:
                t = time.perf_counter()
                page.wait_for_selector(sel, state="visible", timeout=timeout_s * 1000)
                return time.perf_counter() - t

            t = time.perf_counter()
            page.goto(f"{url}/?view=runs")  # the browser loads Dash's scripts once (plotly.js on the first figure)
            page.wait_for_selector("#runs-table", state="visible")
            out["runs page, browser cold_s"] = round(time.perf_counter() - t, 2)
            for run in runs:
                page.goto(f"{url}/?view=runs")
                page.wait_for_selector("#runs-table", state="visible")
                page.wait_for_timeout(3000)  # a user reads the list (the page prefetches plotly.js meanwhile)
                for visit in ("cold", "revisit"):
                    t = time.perf_counter()
                    if visit == "cold":  # opened from the Runs list, as a user does
                        page.click(f"#runs-table a >> text='{run}'")
                    else:
                        page.goto(f"{url}/?run={run}&view=overview")
                    page.wait_for_selector(VIEW_READY["overview"], state="visible", timeout=300_000)
                    page.wait_for_selector("#card", state="visible", timeout=300_000)
                    out[f"{run}: overview {visit} visit, drawn_s"] = round(time.perf_counter() - t, 2)
                    if visit == "cold":
                        out[f"{run}: card's analysis done after_s"] = round(time.perf_counter() - t + until("#card-culprit", 900), 2)
                for view in ("heatmap", "outliers", "tensor", "live", "overview", "heatmap", "outliers"):
                    t = time.perf_counter()
                    page.click(f"#nav-{view}")
                    page.wait_for_selector(VIEW_READY[view], state="visible", timeout=300_000)
                    out[f"{run}: switch to {view}_s"] = max(out.get(f"{run}: switch to {view}_s", 0),
                                                            round(time.perf_counter() - t, 2))
            browser.close()
    finally:
        srv.terminate()
        srv.wait(20)
    return out


def live_lag(root: Path, seconds: float = 40.0) -> dict:
    """How late new steps appear on the Live view while a demo training run uses the CPU: sampled every
    0.25 s in Chromium, each sample's lag = how long the oldest step that had ended (its ``time`` in the
    scalars table) but was not yet shown had been waiting."""
    import subprocess

    from playwright.sync_api import sync_playwright

    import fp8scope

    run = root / "livelag"
    shutil.rmtree(run, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    train = subprocess.Popen([sys.executable, "-m", "fp8scope.demo.train", "--steps", "1000000", "--run-dir", str(run),
                              "--quiet", "--overwrite"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    srv, url = start_server(root)
    samples: list[tuple[float, int]] = []
    try:
        deadline = time.time() + 120
        while not (run / "streams").is_dir() or not list((run / "streams").glob("scalars-*")):
            if time.time() > deadline:
                raise SystemExit("the training run never started")
            time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless=new", "--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{url}/?run=livelag&view=live")
            page.wait_for_selector("#live-last-step", timeout=120_000)
            end = time.time() + seconds
            while time.time() < end:
                txt = page.inner_text("#live-last-step")
                if txt.strip().isdigit():
                    samples.append((time.time(), int(txt)))
                page.wait_for_timeout(250)
            browser.close()
    finally:
        srv.terminate()
        train.terminate()
        srv.wait(20)
        train.wait(20)
    sc = fp8scope.load_run(run).scalars()
    ended = sc.groupby("step")["time"].min().sort_index()
    steps, times = ended.index.to_numpy(), ended.to_numpy()
    lags = []
    for w, shown in samples:
        i = np.searchsorted(steps, shown, side="right")  # the first step after the shown one
        lags.append(max(0.0, w - times[i]) if i < len(steps) and times[i] <= w else 0.0)
    lags = np.array(lags)
    return {"live: samples": len(lags), "live: steps trained per s": round(float(len(steps) / max(1e-9, times[-1] - times[0])), 1),
            "live: new step shown after, median_s": round(float(np.median(lags)), 2),
            "live: new step shown after, p95_s": round(float(np.quantile(lags, 0.95)), 2),
            "live: new step shown after, max_s": round(float(lags.max()), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--layers", type=int, default=336, help="linear layers; 3 tensor roles each (336 -> 1008 tensors)")
    ap.add_argument("--root", default="/tmp/fp8scope-bench")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a run generated earlier; the live test then appends as a restarted job (new segment)")
    ap.add_argument("--json", help="also write results here")
    ap.add_argument("--recipes", type=int, default=0,
                    help="also write a recipes table (the first N what-if recipes on every full step) and time the "
                         "views that read it")
    ap.add_argument("--browser", action="store_true", help="also time views in headless Chromium (real server)")
    ap.add_argument("--demo", help="with --browser: also time this run folder (copied under the root as 'demo')")
    ap.add_argument("--live-seconds", type=float, default=0,
                    help="with --browser: also measure, for this many seconds, how late a training run's new steps "
                         "appear on the Live view")
    args = ap.parse_args()

    root = Path(args.root)
    run_dir = root / "big"
    from fp8scope.detect.advisor import COST_ORDER

    recipes = COST_ORDER[:args.recipes]
    stamp = root / f".made-{args.steps}x{args.layers}x{len(recipes)}"
    writer = None
    if not (args.reuse and stamp.exists()):
        shutil.rmtree(root, ignore_errors=True)
        # the writer stays open, as in a live run: the live test appends to the same stream
        t, writer = timed(lambda: make_big_run(run_dir, args.steps, args.layers, close=False, recipes=recipes))
        root.mkdir(parents=True, exist_ok=True)
        stamp.write_text("ok")
        print(f"generated {args.steps} steps x {args.layers * 3} tensors in {t:.1f} s "
              f"({sum(f.stat().st_size for f in run_dir.rglob('*') if f.is_file()) / 2**20:.0f} MiB)")

    from dashboard.app import DashboardApp, parse

    res: dict[str, float | int | str] = {"steps": args.steps, "tensors": args.layers * 3,
                                         "rows": args.steps * args.layers * 3}
    app = DashboardApp(root)

    def page(q):
        out = app.render(parse(q))
        s = str(out)
        if "error-card" in s:
            raise SystemExit(f"error card on {q}: {s[s.index('error-card') - 400:s.index('error-card')]}")
        return out

    t, out = timed(lambda: page("?view=runs"))
    res["first_page_runs_s"] = round(t, 3)
    t0 = time.perf_counter()
    e = app.cache.get(run_dir)
    res["load_run_s"] = round(time.perf_counter() - t0, 3)
    # opening a run starts a background warm-up (per-(tensor, bucket) rollup + default views); the
    # first view waits for it, so time it on its own: "cold" below is the first request after it.
    e.warmed.wait()
    res["background_warm_up_s"] = round(time.perf_counter() - t0 - res["load_run_s"], 3)
    res["load_plus_warm_up_s"] = round(time.perf_counter() - t0, 3)
    views = ["overview", "heatmap", "outliers", "tensor", "live", "heatmap&stat=overflow_pct&role=gradient",
             "heatmap&stat=underflow_pct", "heatmap&stat=saturated_pct&role=weight", "heatmap&stat=sqnr_db",
             "heatmap&stat=log2_amax", "heatmap&stat=qerr_log10", "heatmap&stat=headroom&agg=mean",
             "tensor&layer=blocks.25.mlp.up&role=activation"]
    if recipes:  # the views that read the recipes table: heatmap statistics, the tensor view's lines, the advisor
        views += [f"heatmap&stat=recipe_{recipes[-1]}_underflow_pct", f"heatmap&stat=recipe_{recipes[0]}_sqnr_db&role=gradient",
                  "recipes"]
        res["recipe_rows"] = (args.steps // 10) * args.layers * 3 * len(recipes)
    for v in views:
        q = f"?run=big&view={v}"
        tc, out = timed(lambda: page(q))
        tw, out = timed(lambda: page(q), repeat=3)
        tj, n = timed(lambda: payload(out))
        res[f"{v}: cold_s"] = round(tc, 3)
        res[f"{v}: warm_s"] = round(tw, 3)
        res[f"{v}: json_s"] = round(tj, 3)
        res[f"{v}: payload_kb"] = round(n / 1024)
    t, _ = timed(lambda: page("?view=runs"))
    res["runs_page_with_run_loaded_s"] = round(t, 3)
    # live: append 10 steps to a second segment while the run is cached, then refresh; after the steps
    # already there (a reused run holds the 10 an earlier call appended: the same steps again would be
    # a restarted job's rewrite, which changes nothing a refresh can see)
    start = args.steps if writer is not None else int(e.run.info()["last_step"]) + 1
    w = make_big_run(run_dir, 10, args.layers, close=False, start=start, writer=writer)
    t, changed = timed(lambda: app.cache.refresh(run_dir, force=True))
    assert changed
    res["live_refresh_10_new_steps_s" + ("" if writer else " (restarted writer: new segment, dedup path)")] = round(t, 3)
    t, _ = timed(lambda: page("?run=big&view=heatmap"))
    res["heatmap_after_refresh_s"] = round(t, 3)
    w.close()
    import resource

    res["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.browser:
        shutil.rmtree(run_dir / "analysis", ignore_errors=True)  # the card's analysis timed cold
        runs = ["big"]
        if args.demo:
            shutil.rmtree(root / "demo", ignore_errors=True)
            shutil.copytree(args.demo, root / "demo", ignore=shutil.ignore_patterns("analysis"))
            runs.insert(0, "demo")
        res.update(browser_times(root, runs))
        if args.live_seconds:
            res.update(live_lag(root, args.live_seconds))
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
