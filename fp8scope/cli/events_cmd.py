"""``fp8scope events RUN``: the anomalies the detection rules find in a run (offline, from its statistics)."""

from __future__ import annotations

from fp8scope.errors import UsageError

SEVERITY_CHOICES = ("info", "warning", "critical")


def register(sub) -> None:
    p = sub.add_parser("events", help="anomaly events found by the detection rules (docs/detection.md)")
    p.add_argument("run", help="run folder")
    p.add_argument("--severity", choices=SEVERITY_CHOICES, default="info", help="minimum severity to show")
    p.add_argument("--rule", action="append", help="only these rules (repeatable)")
    p.add_argument("--layer", help="regex searched in layer names")
    p.add_argument("--limit", type=int, help="show at most N events")
    p.add_argument("--stored", action="store_true",
                   help="show the events the online detector wrote during training instead of re-detecting")
    p.add_argument("--config", help="JSON file with threshold overrides (DetectConfig field names)")
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p.set_defaults(func=run)


def load_config(path: str | None):
    from fp8scope.detect import DetectConfig

    if not path:
        return DetectConfig()
    import json

    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read --config {path}: {exc}") from None
    if not isinstance(d, dict):
        raise UsageError(f"--config {path} must hold a JSON object of threshold overrides")
    try:
        return DetectConfig.from_dict(d)
    except TypeError as exc:
        raise UsageError(f"bad --config {path}: {exc}") from None


def filter_events(ev, severity: str = "info", rules=None, layer: str | None = None):
    import re

    from fp8scope.detect.rules import SEVERITY_RANK

    ev = ev[ev["severity"].map(SEVERITY_RANK).fillna(0) >= SEVERITY_RANK[severity]]
    if rules:
        ev = ev[ev["rule"].isin(rules)]
    if layer:
        try:
            rx = re.compile(layer)
        except re.error as exc:
            raise UsageError(f"bad --layer regex {layer!r}: {exc}") from None
        ev = ev[ev["layer"].map(lambda s: bool(rx.search(s or "")))]
    return ev.reset_index(drop=True)


def events_json(ev) -> list[dict]:
    import math

    out = []
    for r in ev.to_dict("records"):
        d = {k: r[k] for k in ("step", "rank", "rule", "severity", "layer", "tensor", "value", "threshold", "message")}
        for k in ("value", "threshold"):
            v = d[k]
            d[k] = None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)
        d["step"], d["rank"] = int(d["step"]), int(d["rank"])
        out.append(d)
    return out


def run(args) -> int:
    from fp8scope.cli.output import print_frame, print_json
    from fp8scope.cli.progress import phases
    from fp8scope.detect.analysis import analysis, stored_events
    from fp8scope.detect.engine import open_run, small_pages
    from fp8scope.detect.rules import all_rule_names

    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be >= 1")
    cfg = load_config(args.config)
    if args.rule:
        unknown = sorted(set(args.rule) - set(all_rule_names(cfg)))
        if unknown:
            raise UsageError(f"unknown rule(s) {unknown}; known: {', '.join(all_rule_names(cfg))}")
    with small_pages():  # big short-lived arrays: see small_pages
        r = open_run(args.run)  # zero-copy one-pass read (detection converts only the columns it needs)
        if args.stored:
            ev = stored_events(r)
        else:
            with phases("detecting", 8) as tick:
                ev, _ = analysis(args.run, cfg, progress=tick, run=r)  # the events the report and dashboard count
    ev = filter_events(ev, args.severity, args.rule, args.layer)
    if args.limit:
        ev = ev.head(args.limit)
    if args.json:
        print_json(events_json(ev))
        return 0
    if ev.empty:
        print(f"no events at severity >= {args.severity}")
        return 0
    print_frame(ev, title=f"{args.run}: {len(ev)} events (severity >= {args.severity})",
                columns=["step", "rank", "severity", "rule", "layer", "tensor", "value", "threshold", "message"])
    return 0
