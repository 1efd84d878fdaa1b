"""``fp8scope report RUN``: the post-mortem of a run (first anomaly, NaN origin, top layers, advice)."""

from __future__ import annotations

from fp8scope.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("report", help="post-mortem: what broke first, where, when, and what to try")
    p.add_argument("run", help="run folder")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with figures")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", help="JSON file with threshold overrides (DetectConfig field names)")
    p.set_defaults(func=run)


def run(args) -> int:
    from fp8scope.cli.events_cmd import load_config
    from fp8scope.cli.output import print_json
    from fp8scope.detect.engine import small_pages

    html_path = getattr(args, "html", None)
    if html_path is not None:
        import os

        parent = os.path.dirname(os.path.abspath(html_path))
        if not os.path.isdir(parent):
            raise UsageError(f"--html {html_path}: folder {parent} does not exist")
    cfg = load_config(getattr(args, "config", None))
    with small_pages():  # big short-lived arrays: see small_pages
        rep = _build(args.run, cfg, html_path)
    if getattr(args, "json", False):
        print_json(rep)
        return 0
    print_report(rep)
    if html_path:
        print(f"\nHTML report: {html_path}")
    return 0


def _build(path: str, cfg, html_path: str | None) -> dict:
    """Detect, summarise and (with --html) write the figures, with a progress bar."""
    from fp8scope.cli.progress import phases
    from fp8scope.detect.analysis import analysis
    from fp8scope.detect.engine import open_run
    from fp8scope.detect.report import render_html

    r = open_run(path)  # zero-copy one-pass read (detection converts only the columns it needs)
    with phases("report", 8 + (1 if html_path else 0)) as tick:
        events, rep = analysis(path, cfg, progress=tick, run=r)  # the dashboard's card reads the same
        if html_path:
            tick("figures")
            try:
                render_html(rep, r, events, html_path)
            except OSError as exc:
                raise UsageError(f"cannot write --html {html_path}: {exc}") from None
    return rep


def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.text import Text

    from fp8scope.cli.output import console
    from fp8scope.detect.report import blame_text, culprit_text, short_value
    from fp8scope.store.manifest import describe_mode, recipe_text

    c: Console = console()
    c.print(Text(f"fp8scope report: {rep['run']}", style="bold"))
    c.print(Text(f"{rep['steps']} steps ({rep['first_step']}..{rep['last_step']}), {rep['tensors']} tensors, "
                 f"ranks {rep['ranks']}"))
    m = rep["measured"]
    c.print(Text(f"measured: {describe_mode(m)}"))
    if rep.get("coverage"):
        c.print(Text(rep["coverage"]))
    if m["kind"] != "whatif":
        c.print(Text(f"recipe: {recipe_text(m['recipe'])}"))
    if m["whatif_recipe"]:
        c.print(Text(f"what-if recipe: {recipe_text(m['whatif_recipe'])}"))
    if rep.get("planted"):
        c.print(Text(f"planted (demo): {', '.join(rep['planted'])}"))
    e = rep["events"]["by_severity"]
    c.print(Text(f"events: {e['critical']} critical, {e['warning']} warning, {e['info']} info"))
    c.print(Text(f"\n{blame_text(rep)}", style="bold"))
    c.print(Text(f"culprit: {culprit_text(rep)}"))
    c.print(Text(f"verdict: {rep['verdict']}"))
    if rep["first_anomaly"]:
        f = rep["first_anomaly"]
        c.print(Text(f"\nfirst anomaly: step {f['step']} [{f['rule']}, {f['severity']}] {f['message']}"))
    if rep["nan_origin"]:
        o = rep["nan_origin"]
        c.print(Text(f"NaN origin:    step {o['step']} {o['layer']} {o['tensor']}: {o['message']}"))
    if rep["top_layers"]:
        c.print(Text("\ntop layers:", style="bold"))
        for i, d in enumerate(rep["top_layers"], 1):
            rules = ", ".join(f"{k} x{v}" for k, v in d["rules"].items())
            sim = " (what-if: simulated)" if d.get("whatif") else ""
            c.print(Text(f"{i}. {d['layer']} {d['tensor']}{sim}: {d['worst']}, from step {d['first_step']} ({rules})"))
            for m in d["evidence"]:
                c.print(Text(f"     - {m}"))
    if rep["scalars"]:
        c.print(Text("\nloss / grad-norm:", style="bold"))
        for name, d in rep["scalars"].items():
            parts = [f"{k}={short_value(v)}" for k, v in d.items() if v is not None]
            c.print(Text(f"  {name}: " + ", ".join(parts)))
    if rep.get("shadow"):
        c.print(Text(f"\nFP8 vs BF16 (shadow): {rep['shadow']['verdict']}", style="bold"))
    if rep.get("forks"):
        c.print(Text("\nBF16 forks:", style="bold"))
        for f in rep["forks"]:
            c.print(Text(f"  fork {f['fork_id']} ({f['trigger']}, steps {f['start_step']}..{f['last_step']}): "
                         f"{f['verdict']}: {f['reason']}"))
    c.print(Text("\nwhat to try:", style="bold"))
    for a in rep["advice"]:
        c.print(Text(f"  - {a}"))
