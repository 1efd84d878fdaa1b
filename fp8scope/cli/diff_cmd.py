"""``fp8scope diff RUN_A RUN_B``: where two runs part ways, per layer and tensor.

The runs are joined on (rank, layer, tensor, step). A tensor "diverges" at the first step
where |log2(amax_A / amax_B)| exceeds ``--tol`` binades (default 0.05, ~3.5%) or where one
side is non-finite and the other is not. Scalars (loss, grad_norm) are compared the same way
with ``--scalar-rtol``.
"""

from __future__ import annotations

from fp8scope.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("diff", help="where two runs diverge: first step per layer/tensor whose statistics differ")
    p.add_argument("run_a", help="first run folder (e.g. the good one)")
    p.add_argument("run_b", help="second run folder")
    p.add_argument("--tol", type=float, default=0.05, help="amax tolerance in binades (log2 ratio)")
    p.add_argument("--scalar-rtol", type=float, default=0.05, help="relative tolerance for loss / grad_norm")
    p.add_argument("--limit", type=int, default=30, help="rows to show")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def diff_runs(a, b, tol: float = 0.05, scalar_rtol: float = 0.05):
    import duckdb

    con = duckdb.connect()
    cols = ["step", "rank", "layer", "tensor", "order", "amax", "scale_inv"]
    for name, r in (("ta", a), ("tb", b)):
        if "tensors" not in r.table_names():
            raise UsageError(f"{r.path}: no tensor statistics")
        con.register(name, r.table("tensors").select(cols))
    q = f"""
    with j as (
        select a.rank, a.layer, a.tensor, a."order", a.step, a.amax as amax_a, b.amax as amax_b,
            case when isfinite(a.amax) and isfinite(b.amax) and a.amax > 0 and b.amax > 0
                 then abs(log2(a.amax / b.amax))
                 when isfinite(a.amax) = isfinite(b.amax) and coalesce(a.amax = b.amax, false) then 0
                 when isfinite(a.amax) <> isfinite(b.amax) then 'inf'::double
                 else 0 end as d
        from ta a join tb b using (rank, layer, tensor, step)
    ), f as (
        select *, row_number() over (partition by rank, layer, tensor order by step) as rn
        from j where d > {float(tol)!r}
    ), s as (
        select rank, layer, tensor, min("order") as "order", count(*) as common_steps, max(d) as max_binades
        from j group by all
    )
    select s.rank, s.layer, s.tensor, f.step as first_step, f.amax_a, f.amax_b, f.d as binades,
           s.max_binades, s.common_steps, s."order"
    from s left join f on s.rank = f.rank and s.layer = f.layer and s.tensor = f.tensor and f.rn = 1
    order by f.step nulls last, s."order", s.tensor
    """
    tens = con.execute(q).df()
    scal = None
    if "scalars" in a.table_names() and "scalars" in b.table_names():
        con.register("sa", a.table("scalars").select(["step", "rank", "name", "value"]))
        con.register("sb", b.table("scalars").select(["step", "rank", "name", "value"]))
        scal = con.execute(f"""
            with j as (select a.rank, a.name, a.step, a.value as a, b.value as b from sa a join sb b using (rank, name, step)),
            f as (select *, row_number() over (partition by rank, name order by step) rn from j
                  where not (a = b) and (not isfinite(a) or not isfinite(b)
                        or abs(a - b) > {float(scalar_rtol)!r} * greatest(abs(a), abs(b))))
            select rank, name, step as first_step, a as value_a, b as value_b from f where rn = 1 order by step
        """).df()
    con.close()
    return tens, scal


def run(args) -> int:
    from fp8scope.cli.output import print_frame, print_json
    from fp8scope.cli.progress import phases
    from fp8scope.run import load_run

    if args.tol < 0 or args.scalar_rtol < 0:
        raise UsageError("tolerances must be >= 0")
    with phases("diff", 3) as tick:
        tick("reading runs")
        a, b = load_run(args.run_a), load_run(args.run_b)
        tick("comparing")
        tens, scal = diff_runs(a, b, args.tol, args.scalar_rtol)
    if tens.empty:
        raise UsageError("the runs share no (rank, layer, tensor, step): nothing to compare")
    div = tens[tens["first_step"].notna()]
    if args.json:
        def rows(df):
            out = []
            for d in df.drop(columns=["order"], errors="ignore").to_dict("records"):
                out.append({k: (None if isinstance(v, float) and v != v else (v.item() if hasattr(v, "item") else v))
                            for k, v in d.items()})
            return out
        print_json({"tensors": rows(tens), "scalars": rows(scal) if scal is not None else [],
                    "first_divergence": rows(div.head(1))[0] if not div.empty else None})
        return 0
    if div.empty:
        print(f"no tensor diverges by more than {args.tol:g} binades over {int(tens['common_steps'].max())} common steps")
    else:
        f = div.iloc[0]
        print(f"runs part ways at step {int(f['first_step'])}: {f['layer']} {f['tensor']} "
              f"(amax {f['amax_a']:.4g} vs {f['amax_b']:.4g})")
        print_frame(div.head(args.limit).drop(columns=["order"]),
                    title=f"{len(div)} of {len(tens)} tensors diverge (> {args.tol:g} binades), earliest first")
    if scal is not None and not scal.empty:
        print_frame(scal, title="scalars: first step beyond --scalar-rtol")
    return 0
