"""``fp8scope whatif RUN``: the recipe advisor.

Two answers from the run's own data:

- "which amax_history_len / margin should I use?" (TE issue #1169): the logged amax series replayed
  through per-tensor recipes, per layer and tensor, how many steps would have saturated (amax above
  the range the scale allowed) and how many would have wasted >= RISK binades of range at the top
  (underflow risk);
- "which recipe for which layer?": where the run measured other recipes on its tensors
  (``Monitor(whatif_recipes=...)``), each recipe's underflow, overflow and SQNR, and for each tensor
  the detector would flag, the recipes that remove the fault (``fp8scope.detect.advisor``).
"""

from __future__ import annotations

from fp8scope.errors import UsageError

DEFAULT_COMPARE = "logged,delayed:1024:0,delayed:16:0,delayed:16:1,current"


def register(sub) -> None:
    p = sub.add_parser("whatif", help="replay the logged amax through other scaling recipes (saturation / underflow risk)")
    p.add_argument("run", help="run folder")
    p.add_argument("--recipe", choices=("delayed", "current"), help="one recipe to replay")
    p.add_argument("--amax-history-len", type=int, default=1024, help="delayed: history length")
    p.add_argument("--margin", type=float, default=0.0, help="scale margin in binades")
    p.add_argument("--algo", choices=("max", "most_recent"), default="max", help="delayed: amax_compute_algo")
    p.add_argument("--compare", help="comma-separated recipes: delayed[:HIST[:MARGIN[:ALGO]]], current[:MARGIN], "
                                     f"logged (default when --recipe is not given: {DEFAULT_COMPARE})")
    p.add_argument("--risk-binades", type=float, default=4.0,
                   help="underflow-risk step: range >= amax x 2**RISK (that many binades wasted at the top)")
    p.add_argument("--by-layer", action="store_true", help="sum the tensors of each layer")
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.set_defaults(func=run)


def recipes_from_args(args):
    from fp8scope.detect.whatif import WhatIfRecipe, parse_recipe

    if args.recipe and args.compare:
        raise UsageError("give either --recipe or --compare, not both")
    if args.amax_history_len < 1:
        raise UsageError("--amax-history-len must be >= 1")
    if args.margin < 0:
        raise UsageError("--margin must be >= 0")
    if args.recipe == "delayed":
        r = WhatIfRecipe("delayed", args.amax_history_len, args.margin, args.algo)
        return [parse_recipe("logged"), parse_recipe(r.label)]
    if args.recipe == "current":
        return [parse_recipe("logged"), WhatIfRecipe("current", margin=args.margin)]
    specs = [s for s in (args.compare or DEFAULT_COMPARE).split(",") if s.strip()]
    if not specs:
        raise UsageError("--compare needs at least one recipe")
    out = list(dict.fromkeys(parse_recipe(s) for s in specs))
    return out


def run(args) -> int:
    from fp8scope.cli.output import print_frame, print_json
    from fp8scope.cli.progress import items
    from fp8scope.detect.whatif import SAT_WEIGHT, pivot, recommend, replay
    from fp8scope.run import load_run

    from fp8scope.detect.advisor import advise, per_step, summed

    recipes = recipes_from_args(args)
    r = load_run(args.run)
    if "tensors" not in r.table_names():
        raise UsageError(f"{args.run}: no tensor statistics to replay")
    rows = per_step(r)
    by_recipe = summed(rows)
    advice, summary = advise(rows)
    with items("replaying recipes", len(recipes)) as advance:
        res = replay(r, recipes, risk_binades=args.risk_binades, progress=advance)
    if args.json:
        rows = res.drop(columns=["order"]).to_dict("records")
        for d in rows:
            for k, v in list(d.items()):
                if hasattr(v, "item"):
                    d[k] = v.item()
                if isinstance(d[k], float) and d[k] != d[k]:
                    d[k] = None
        print_json({"rows": rows, "recommendation": recommend(res),
                    "recipes": _records(by_recipe), "advice": [a.__dict__ for a in advice], "recipe_summary": summary})
        return 0
    if res.empty:
        print(f"{args.run}: every layer is block-scaled (NVFP4): no per-tensor amax history to replay")
    else:
        table = pivot(res, by_layer=args.by_layer)
        print_frame(table, title=f"{args.run}: saturation steps / underflow-risk steps (>= {args.risk_binades:g} "
                                 "binades of headroom) per recipe")
        rec = recommend(res)
        if rec["recipe"] is None:
            print(rec["why"])
        else:
            print(f"recommended: {rec['recipe']} ({rec['why']}; a clipped step counts {SAT_WEIGHT}x an "
                  "underflow-risk step)")
    if not by_recipe.empty:
        print_recipes(by_recipe, advice, summary, args.run)
    return 0


def print_recipes(table, advice, summary, run: str) -> None:
    from fp8scope.cli.output import print_frame

    shown = table.assign(underflow_pct=100 * table["underflow_frac"], overflow_pct=100 * table["overflow_frac"])
    wide = shown.pivot_table(index=["layer", "tensor"], columns="recipe", values=["underflow_pct", "sqnr_db"],
                             sort=False)
    wide.columns = [f"{recipe} {'underflow %' if v == 'underflow_pct' else 'SQNR dB'}" for v, recipe in wide.columns]
    print_frame(wide.reset_index().round(3), title=f"{run}: each recipe on the run's own tensors (full-stats steps)")
    for line in summary:
        print(line)
    if not advice:
        print("no tensor is at fault under the recipe in use: nothing to change")
    for a in advice:
        print(a.text())


def _records(table) -> list[dict]:
    out = table.to_dict("records")
    for d in out:
        for k, v in list(d.items()):
            if hasattr(v, "item"):
                v = d[k] = v.item()
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                d[k] = None
    return out
