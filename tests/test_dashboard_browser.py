"""Browser tests: the real dashboard (subprocess) driven by Playwright in Debian's Chromium.

Never runs `playwright install`: uses /usr/bin/chromium and skips when it is missing.
Saves a screenshot of each main view (under docs/img/ with FP8SCOPE_SCREENSHOTS=1).
"""

from __future__ import annotations

import json
import os
import tempfile
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import free_port

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ROOT_DIR = Path(__file__).resolve().parents[1]
# Screenshots for the docs are refreshed only on request (FP8SCOPE_SCREENSHOTS=1), so a test
# run never rewrites tracked files; otherwise they go to a scratch folder and are still taken.
IMG = ROOT_DIR / "docs" / "img" if os.environ.get("FP8SCOPE_SCREENSHOTS") else Path(tempfile.gettempdir()) / "fp8scope-shots"
PY = sys.executable
XSS_LAYER = "blocks.0.<img src=x onerror=window.__xss=1>"

if not os.path.exists(CHROMIUM):
    pytest.skip("needs Debian's chromium at /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("dash")

TRAIN = ["-m", "fp8scope.demo.train", "--n-layers", "4", "--d-model", "32", "--n-heads", "2", "--seq-len", "32",
         "--batch-size", "4", "--corpus-chars", "20000", "--every", "5", "--quiet", "--overwrite"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _xss_run(path: Path) -> None:
    """A run written directly with RunWriter whose layer name and event message carry HTML."""
    import numpy as np
    import pyarrow as pa

    from fp8scope.schema import EVENT_SCHEMA, TENSOR_SCHEMA
    from fp8scope.store.manifest import new_manifest, write_manifest
    from fp8scope.store.writer import RunWriter

    write_manifest(path, new_manifest(meta={"model": "xss"}))
    with RunWriter(path) as w:
        for step in range(40):
            n = 2
            amax = np.array([1.0 if step != 30 else 900.0, 3.0])
            cols = {f.name: pa.nulls(n, f.type) for f in TENSOR_SCHEMA}
            cols.update(step=pa.array([step] * n, pa.int64()), rank=pa.array([0] * n, pa.int32()),
                        layer=pa.array([XSS_LAYER, "blocks.1.fc"]), tensor=pa.array(["activation"] * n),
                        order=pa.array([0, 1], pa.int32()), amax=pa.array(amax), scale_inv=pa.array([1.0, 1.0]),
                        fp8_max=pa.array([448.0, 448.0]), expected_amax=pa.array([448.0, 448.0]),
                        numel=pa.array([100, 100], pa.int64()), overflow=pa.array([0, 0], pa.int64()),
                        underflow=pa.array([1, 2], pa.int64()), saturated=pa.array([0, 0], pa.int64()))
            w.write("tensors", pa.record_batch([cols[f.name] for f in TENSOR_SCHEMA], schema=TENSOR_SCHEMA))
        w.write("events", pa.record_batch(
            [pa.array([6], pa.int64()), pa.array([0], pa.int32()), pa.array(["amax_outlier"]), pa.array(["critical"]),
             pa.array([XSS_LAYER]), pa.array(["activation"]), pa.array([900.0]), pa.array([448.0]),
             pa.array(["<script>window.__xss=2</script><b>bold</b>"])], schema=EVENT_SCHEMA))


# every kind of fault the demo can plant (fp8scope/demo/inject.py), in the 4-layer model, 60 steps
PLANTED = {"outlier": "outlier:blocks.2.mlp.down:40:1000:2", "nan": "nan:blocks.1.mlp.up:40",
           "gradscale": "gradscale:blocks.1.attn.qkv:40", "lr": "lr:40:30", "grow": "grow:blocks.2.mlp.down:10",
           "reset": "reset:blocks.1.mlp.up:40", "batch": "batch:40"}


def _planted_runs(root: Path) -> None:
    """One run per planted fault, written by two processes (each imports torch once)."""
    common = [a for a in TRAIN[2:] if a != "--quiet"] + ["--quiet", "--steps", "60"]
    jobs = [[*common, "--run-dir", str(root / f"planted-{k}"), "--inject", spec] for k, spec in PLANTED.items()]
    code = ("import json, sys\nfrom fp8scope.demo.train import main\n"
            "for argv in json.loads(sys.argv[1]):\n    main(argv)\n")
    procs = [subprocess.Popen([PY, "-c", code, json.dumps(jobs[i::2])], env=_env(), cwd=ROOT_DIR) for i in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("dash")
    root = base / "runs"
    root.mkdir()
    outside = base / "outside-run"
    # the logged demo run, with an outlier planted in blocks.1.mlp.down at step 12 (1000x: clipped far beyond
    # what warm-up may mute)
    subprocess.run([PY, *TRAIN, "--steps", "24", "--run-dir", str(root / "demo"),
                    "--inject", "outlier:blocks.1.mlp.down:12:1000:2", "--whatif-recipes", "current,mxfp8"],
                   check=True, env=_env(), cwd=ROOT_DIR, timeout=240)
    shutil.copytree(root / "demo", outside)  # a real run outside the root
    os.symlink(outside, root / "escape")  # symlink out of the root: must be refused
    (root / "bad").mkdir()
    (root / "bad" / "run.json").write_text("{not json")
    (root / "torn").mkdir()
    shutil.copytree(root / "demo", root / "torn", dirs_exist_ok=True)
    s = root / "torn" / "streams" / "tensors-r00000-s0000.arrows"
    s.write_bytes(s.read_bytes()[:-1000])  # crashed mid-write: torn tail
    _xss_run(root / "xss")
    _planted_runs(root)
    port = free_port()
    log = open(base / "server.log", "w")
    srv = subprocess.Popen([PY, "-m", "fp8scope", "dashboard", str(root), "--port", str(port), "--refresh-ms", "700"],
                           stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT_DIR)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if srv.poll() is not None:
                raise RuntimeError((base / "server.log").read_text())
            time.sleep(0.1)
    yield {"root": root, "url": url, "base": base, "port": port}
    srv.terminate()
    try:
        srv.wait(10)
    except subprocess.TimeoutExpired:
        srv.kill()
    log.close()


@pytest.fixture(scope="module")
def page(env):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        pg = browser.new_page(viewport={"width": 1180, "height": 820})
        errors: list[str] = []
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        pg.errors = errors
        yield pg
        browser.close()


def shot(pg, name):
    IMG.mkdir(parents=True, exist_ok=True)
    pg.wait_for_timeout(300)
    pg.screenshot(path=str(IMG / f"{name}.png"))


def yticks(pg, graph="#heatmap-graph"):
    return pg.eval_on_selector_all(f"{graph} .ytick text", "els => els.map(e => e.textContent)")


def go(pg, env, query, wait="#page > *"):
    pg.goto(env["url"] + "/" + query)
    pg.wait_for_selector(wait, timeout=30000, state="attached")


def test_runs_view_lists_runs_with_status(page, env):
    go(page, env, "", "#runs-table")
    text = page.inner_text("#runs-table")
    for name in ("demo", "bad", "torn", "xss"):
        assert name in text
    assert "escape" not in text  # symlink out of the root is never listed
    rows = {r.split("\t")[0].strip(): r for r in text.splitlines()}
    assert "finished" in rows["demo"] and "error" in rows["bad"]
    assert "crashed" in rows["torn"] or "live" in rows["torn"]  # stream not closed
    shot(page, "runs")


def test_overview_and_heatmap_render_layers(page, env):
    go(page, env, "?run=demo&view=overview", "#verdict")
    page.wait_for_selector("#overview-scalars .main-svg")
    assert "shadow" in page.inner_text("#page")  # says plainly there is no shadow table
    shot(page, "overview")
    go(page, env, "?run=demo&view=heatmap", "#heatmap-graph .ytick")
    ticks = yticks(page)
    assert "blocks.1.mlp.down" in ticks and "blocks.0.attn.qkv" in ticks
    shot(page, "heatmap")
    # choose another statistic and role through the controls
    go(page, env, "?run=demo&view=heatmap&stat=underflow_pct&role=gradient", "#heatmap-graph .ytick")
    assert "blocks.1.mlp.down" in yticks(page)


def cells(pg, table: str, column: str) -> list[str]:
    return pg.eval_on_selector_all(f"#{table} td[data-dash-column='{column}']", "els => els.map(e => e.innerText)")


def test_outliers_click_through_to_tensor(page, env):
    go(page, env, "?run=demo&view=outliers", "#outliers-table td")
    layers, roles = cells(page, "outliers-table", "layer"), cells(page, "outliers-table", "role")
    assert len(layers) >= 20  # the first page of a paged table
    assert (layers[0], roles[0]) == ("blocks.1.mlp.down", "activation"), list(zip(layers, roles))[:5]
    shot(page, "outliers")
    page.locator("#outliers-table td[data-dash-column='layer']").first.click()  # a click on a row opens it
    page.wait_for_selector("#tensor-amax .main-svg", timeout=30000)
    assert page.inner_text("#tensor-title") == "blocks.1.mlp.down / activation"
    assert "source emulated, recipe delayed;" in page.inner_text("#body .muted")  # the tensor's own recipe
    assert "view=tensor" in page.url
    shot(page, "tensor")


def test_recipes_view_gives_the_advisor(page, env):
    """The run measured per-tensor current scaling and MXFP8 beside its own recipe: the Recipes view
    lists each per tensor, with the advisor's summary (the one analysis `fp8scope whatif` prints)."""
    go(page, env, "?run=demo&view=recipes", "#recipes-table td")
    recipes = set(cells(page, "recipes-table", "recipe"))
    assert recipes == {"the recipe in use", "per-tensor current FP8", "MXFP8"}
    layers, roles = cells(page, "recipes-table", "layer"), cells(page, "recipes-table", "role")
    assert layers[:3] == ["blocks.0.attn.qkv"] * 3 and len(set(roles[:3])) == 1  # a tensor's recipes together
    assert "MXFP8" in page.inner_text("#recipes-summary")
    shot(page, "recipes")
    # the heatmap takes a what-if recipe as its statistic
    go(page, env, "?run=demo&view=heatmap&stat=recipe_mxfp8_underflow_pct&role=activation", "#heatmap-graph .ytick")
    assert "blocks.0.attn.qkv" in yticks(page) and "what-if recipe" in page.inner_text("#page")
    # the tensor view carries each measured recipe's underflow % (in the legend, shown on a click)
    go(page, env, "?run=demo&view=tensor&layer=blocks.0.mlp.up&role=activation", "#tensor-amax .legendtext")
    legend = page.eval_on_selector_all("#tensor-amax .legendtext", "els => els.map(e => e.textContent)")
    assert "underflow % under MXFP8 (what-if)" in legend, legend
    go(page, env, "?run=xss&view=recipes", "#recipes-none")  # a run without recipes says how to get them
    assert "whatif_recipes" in page.inner_text("#recipes-none")


def test_path_traversal_is_refused(page, env):
    for q in ("?run=../outside-run&view=overview", "?run=" + str(env["base"] / "outside-run") + "&view=overview",
              "?run=escape&view=heatmap", "?run=demo/../../outside-run&view=overview", "?run=%2Fetc&view=tensor",
              "?view=compare&run=demo&b=../outside-run"):
        go(page, env, q, ".error-card, .note")
        assert "Refused" in page.inner_text("#page"), q
        assert page.locator("#heatmap-graph, #overview-scalars").count() == 0
    for path in ("/assets/../../../etc/passwd", "/assets/%2e%2e/%2e%2e/etc/passwd", "/_dash-component-suites/../../run.json"):
        try:
            body = urllib.request.urlopen(env["url"] + path, timeout=5).read()
        except urllib.error.HTTPError:
            continue
        assert b"root:" not in body and b"schema_version" not in body


def test_malformed_run_shows_error_card_and_app_keeps_working(page, env):
    go(page, env, "?run=bad&view=overview", ".error-card")
    assert "could not be read" in page.inner_text(".error-card")
    assert "Traceback" not in page.content()
    go(page, env, "?run=torn&view=heatmap", "#heatmap-graph .ytick")  # torn tail: the complete part is shown
    go(page, env, "?run=demo&view=overview", "#verdict")


def test_html_in_layer_names_is_inert(page, env):
    go(page, env, "?run=xss&view=outliers", "#outliers-table td")
    assert XSS_LAYER in page.inner_text("#outliers-table")
    go(page, env, "?run=xss&view=heatmap", "#heatmap-graph .ytick")
    go(page, env, "?run=xss&view=overview", "#events-table td")  # the analysis flags the hostile layer's spike
    assert XSS_LAYER in page.inner_text("#events-table")
    assert XSS_LAYER in page.inner_text("#card-culprit")
    go(page, env, f"?run=xss&view=tensor&layer={urllib.parse.quote(XSS_LAYER)}&role=activation", "#tensor-amax .main-svg")
    page.wait_for_timeout(500)
    assert page.evaluate("window.__xss") is None
    assert page.locator("img[src='x']").count() == 0


def _report(run: Path) -> dict:
    out = subprocess.run([PY, "-m", "fp8scope", "report", str(run), "--json"], capture_output=True, text=True,
                         env=_env(), cwd=ROOT_DIR, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("kind", list(PLANTED))
def test_card_gives_the_reports_verdict(page, env, kind):
    """The first screen names the same verdict, culprit and first anomaly as fp8scope report --json."""
    from fp8scope.detect.report import BLAME_TITLES

    run = f"planted-{kind}"
    go(page, env, f"?run={run}&view=overview", "#card-culprit")  # the card shows once the analysis is done
    rep = _report(env["root"] / run)
    assert BLAME_TITLES[rep["blame"]["level"]] in page.inner_text("#verdict")
    assert rep["blame"]["why"] in page.inner_text("#verdict")
    culprit = page.inner_text("#card-culprit")
    c = rep["culprit"]
    if c is None:
        assert culprit.startswith("Culprit: none"), culprit
    else:
        assert f"{c['layer']} {c['tensor']} at step {c['step']} ({c['rule']})" in culprit, (culprit, c)
    first = page.inner_text("#card-first")
    f = rep["first_anomaly"]
    assert (f"step {f['step']}, {f['rule']} ({f['severity']})" in first) if f else "none" in first, (first, f)
    sev = rep["events"]["by_severity"]
    assert f"{sev['critical']} critical, {sev['warning']} warning, {sev['info']} info" in page.inner_text("#card-counts")
    if rep["nan_origin"]:
        o = rep["nan_origin"]
        assert f"{o['layer']} {o['tensor']} at step {o['step']}" in page.inner_text("#card-nan")
    if c is not None:  # the culprit links to its tensor, and the Tensor view opens it by default
        page.locator("#card-culprit a").click()
        page.wait_for_selector("#tensor-title", timeout=30000)
        assert page.inner_text("#tensor-title") == f"{c['layer']} / {c['tensor']}"
    if kind == "outlier":  # the planted layer leads the Outliers ranking too
        go(page, env, f"?run={run}&view=outliers", "#outliers-table td")
        assert (cells(page, "outliers-table", "layer")[0], cells(page, "outliers-table", "role")[0]) == \
            ("blocks.2.mlp.down", "activation")


def test_live_run_gains_steps(page, env):
    root = env["root"]
    # far more steps than the test needs (it is terminated below): a run that finishes while the page
    # loads would read "finished", and 400 steps of this model take ~5 s on a fast core
    proc = subprocess.Popen([PY, *TRAIN, "--steps", "100000", "--run-dir", str(root / "live")], env=_env(),
                            cwd=ROOT_DIR,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while not list((root / "live" / "streams").glob("scalars-*")) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        go(page, env, "?run=live&view=live", "#live-last-step")
        first = int(page.inner_text("#live-last-step"))
        # no reload: the interval refresh must bring new steps in
        page.wait_for_function(f"Number(document.querySelector('#live-last-step')?.innerText) >= {first + 3}",
                               timeout=60000)
        assert "live" in page.inner_text(".status")
        page.wait_for_selector("#live-heatmap .main-svg")
        shot(page, "live")
        # a refresh redraws figures, never the controls: a dropdown opened by hand stays open while new
        # steps arrive
        go(page, env, "?run=live&view=heatmap&stat=log2_amax", "#heatmap-graph .main-svg")
        cols = lambda: int(page.inner_text("#body .muted").split(" x ")[1].split(" ")[0])  # noqa: E731
        before = cols()
        page.locator("div:has(> label:text-is('tensor role')) .dash-dropdown").first.click()
        page.wait_for_selector(".dash-dropdown-content", timeout=5000)
        deadline = time.time() + 60
        while cols() <= before + 2 and time.time() < deadline:
            page.wait_for_timeout(300)
        assert cols() > before + 2, "new steps did not appear without a reload"
        assert page.locator(".dash-dropdown-content").is_visible(), "the refresh closed the open dropdown"
        page.keyboard.press("Escape")
        go(page, env, "?run=demo&b=live&view=compare", "#compare-loss .main-svg")
        page.wait_for_selector("#compare-heat-b .main-svg")
        shot(page, "compare")
    finally:
        proc.terminate()
        proc.wait(20)
    assert not [e for e in page.errors if "xss" in e.lower()]
