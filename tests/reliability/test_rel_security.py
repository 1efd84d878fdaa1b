"""Security: nothing unsafe in the read path, dashboard local by default, no path traversal,
hostile layer names rendered inert (HTML report and dashboard)."""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest

from rel_common import ROOT, cli_inproc

SCANNED = [ROOT / "fp8scope", ROOT / "dashboard"]
PAYLOADS = [
    "<script>alert('xss')</script>",
    "</script><script>alert(1)</script>",
    '"><img src=x onerror=alert(2)>',
    "javascript:alert(3)",
    "{{7*7}}<b>bold</b>&amp;",
]


def _py_files():
    for base in SCANNED:
        if base.exists():
            yield from sorted(p for p in base.rglob("*.py") if ".venv" not in p.parts)


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def unsafe_calls(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] in ("pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"):
                    bad.append(f"line {node.lineno}: import {m}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if name in ("eval", "exec", "builtins.eval", "builtins.exec", "compile"):
            bad.append(f"line {node.lineno}: {name}()")
        if name.endswith("torch.load"):
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                bad.append(f"line {node.lineno}: torch.load without weights_only=True")
        if name.endswith("yaml.load") or name.endswith("yaml.load_all"):
            loader = _kw(node, "Loader")
            if loader is None or "Safe" not in _dotted(loader):
                bad.append(f"line {node.lineno}: {name} without SafeLoader")
        if name.endswith("yaml.unsafe_load") or name.endswith("read_pickle") or last in ("loads",) and "pickle" in name:
            bad.append(f"line {node.lineno}: {name}")
        if last == "load" and name.startswith(("np.", "numpy.")):
            ap = _kw(node, "allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                bad.append(f"line {node.lineno}: {name}(allow_pickle=...)")
        sh = _kw(node, "shell")
        if name.startswith("subprocess.") and isinstance(sh, ast.Constant) and sh.value is True:
            bad.append(f"line {node.lineno}: {name}(shell=True)")
        dang = _kw(node, "dangerously_allow_html")
        if isinstance(dang, ast.Constant) and dang.value is True:
            bad.append(f"line {node.lineno}: dangerously_allow_html=True")
    return bad


def test_scanner_catches_what_it_should():
    src = ("import pickle\nimport torch, yaml\nx = torch.load('f')\ny = torch.load('f', weights_only=False)\n"
           "eval('1')\nexec('2')\nyaml.load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
           "import numpy as np\nnp.load('a', allow_pickle=True)\nhtml.Div(dangerously_allow_html=True)\n"
           "torch.load('ok', weights_only=True)\n")
    found = unsafe_calls(ast.parse(src))
    assert len(found) == 8, found


def test_no_pickle_eval_or_unsafe_load_in_the_package_or_dashboard():
    problems = {}
    n = 0
    for p in _py_files():
        n += 1
        bad = unsafe_calls(ast.parse(p.read_text(), filename=str(p)))
        if bad:
            problems[str(p.relative_to(ROOT))] = bad
    assert n > 20
    assert not problems, json.dumps(problems, indent=1)


# ---- dashboard -----------------------------------------------------------------------------
def test_dashboard_binds_to_localhost_by_default(monkeypatch, tmp_path):
    pytest.importorskip("dash")
    from fp8scope.cli.main import build_parser

    args = build_parser().parse_args(["dashboard", str(tmp_path)])
    assert args.host == "127.0.0.1"
    import dashboard.app

    calls = {}

    class FakeApp:
        def run(self, **kw):
            calls.update(kw)

    monkeypatch.setattr(dashboard.app, "create_app", lambda *a, **k: FakeApp())
    rc, _, err = cli_inproc("dashboard", tmp_path)
    assert rc == 0, err
    assert calls.get("host") == "127.0.0.1" and calls.get("debug") is False, calls


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    from rel_fuzz_streams import make_run

    root = tmp_path_factory.mktemp("root") / "runs"
    make_run(root / "good")
    secret = root.parent / "secret"
    make_run(secret)  # a real run outside the root: must never be served
    (root.parent / "passwd").write_text("root:x:0:0")
    (root / "escape").symlink_to(secret)
    return root


TRAVERSALS = ["../secret", "../../etc", "/etc", "/", "~", "~root", "good/../../secret", "..", ".", "", "good/..",
              "escape", "..\\secret", "good\x00", "C:\\Windows", "%2e%2e/secret", "good/" * 5 + "x", "a" * 5000,
              "good//", "./good"]


@pytest.mark.parametrize("name", TRAVERSALS, ids=[f"t{i}" for i in range(len(TRAVERSALS))])
def test_run_names_cannot_escape_the_root(runs_root, name):
    pytest.importorskip("dash")
    from dashboard.paths import PathRejected, RunsRoot

    with pytest.raises(PathRejected):
        RunsRoot(runs_root).resolve(name)


def test_run_list_and_urls_never_show_outside_runs(runs_root):
    pytest.importorskip("dash")
    from urllib.parse import quote

    from dashboard.app import DashboardApp, parse
    from dashboard.paths import RunsRoot

    assert RunsRoot(runs_root).list_runs() == ["good"]
    app = DashboardApp(runs_root)
    for name in TRAVERSALS:
        for view in ("overview", "heatmap", "outliers", "tensor", "live", "compare"):
            page = app.render(parse(f"?view={view}&run={quote(name)}&b={quote(name)}"))
            text = json.dumps(page, default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o))
            assert "Refused" in text or "Pick a run" in text, (name, view, text[:300])
            assert "secret" not in text.replace("../secret", "").replace("..\\\\secret", "") or "Refused" in text
    page = app.render(parse("?view=compare&run=good&b=../secret"))
    text = json.dumps(page, default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o))
    assert "l0" not in text or "Refused" in text or "could not" in text  # run b outside the root never loads


def test_http_routes_do_not_serve_files_outside(runs_root):
    pytest.importorskip("dash")
    from dashboard.app import create_app

    client = create_app(runs_root).server.test_client()
    for url in ["/assets/../../../../etc/passwd", "/assets/..%2f..%2f..%2fpasswd", "/assets/%2e%2e/%2e%2e/app.py",
                "/_dash-component-suites/../../../etc/passwd", "/../passwd", "/%2e%2e/%2e%2e/etc/passwd"]:
        r = client.get(url)
        body = r.get_data(as_text=True)
        assert "root:x:0:0" not in body and "def create_app" not in body, url


# ---- hostile layer names ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    import pyarrow as pa

    from fp8scope.schema import TENSOR_SCHEMA
    from fp8scope.step_records import scalar_batch
    from fp8scope.store import RunWriter, new_manifest, write_manifest
    from rel_fuzz_streams import tensor_rows

    root = tmp_path_factory.mktemp("hostile")
    run = root / "run"
    layers = PAYLOADS
    write_manifest(run, new_manifest(meta={"note": PAYLOADS[0]},
                                     tensors=[{"layer": l, "tensor": "activation"} for l in layers]))
    w = RunWriter(run, 0)
    for s in range(30):
        b = tensor_rows(s, 0, n=3 * len(layers))
        names = pa.array([layers[i // 3] for i in range(b.num_rows)])
        b = b.set_column(TENSOR_SCHEMA.get_field_index("layer"), "layer", names)
        amax = pa.array([1.0 if s < 20 else float("nan")] * b.num_rows)  # something for the report to flag
        b = b.set_column(TENSOR_SCHEMA.get_field_index("amax"), "amax", amax)
        w.write("tensors", b)
        w.write("scalars", scalar_batch(s, 0, ["loss"], [1.0 if s < 20 else float("nan")], time.time()))
    w.close()
    return run


def _assert_inert_html(text: str) -> None:
    """No payload survives as markup: every '<' of a name is &lt; in HTML or \\u003c inside JSON."""
    import re

    assert not re.search(r"<script>\s*alert", text), "a name became a <script> element"
    assert not re.search(r"<img[^>]*onerror", text, re.I), "a name became an <img onerror> element"
    assert "<b>bold</b>" not in text
    assert not re.search(r"href\s*=\s*[\"']?javascript:", text, re.I), "a name became a javascript: link"


def test_html_report_escapes_layer_names(hostile_run, tmp_path):
    pytest.importorskip("plotly")
    try:
        import fp8scope.cli.report_cmd  # noqa: F401
    except ImportError:
        pytest.skip("report command not built yet")
    out = tmp_path / "r.html"
    rc, stdout, err = cli_inproc("report", hostile_run, "--html", out)
    assert rc == 0, err
    text = out.read_text()
    assert "alert" in text, "the hostile names should appear (escaped) in the report"
    _assert_inert_html(text)


def test_dashboard_renders_layer_names_as_text(hostile_run, tmp_path):
    pytest.importorskip("dash")
    from dashboard.app import DashboardApp, parse

    root = hostile_run.parent
    app = DashboardApp(root)
    for view in ("runs", "overview", "heatmap", "outliers", "live"):
        page = app.render(parse(f"?view={view}&run=run"))
        tree = json.dumps(page, default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o))
        assert "dangerously_allow_html" not in tree or '"dangerously_allow_html": false' in tree
        assert '"type": "Markdown"' not in tree or not any(p in tree for p in PAYLOADS)
    for p in PAYLOADS:  # the tensor page of each hostile layer
        from urllib.parse import quote

        page = app.render(parse(f"?view=tensor&run=run&layer={quote(p)}&role=activation"))
        tree = json.dumps(page, default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o))
        assert "could not be read" not in tree, tree[:500]
        assert "dangerously_allow_html\": true" not in tree
