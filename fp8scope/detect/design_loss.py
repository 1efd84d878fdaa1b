"""What a recipe loses by design, on tensors with nothing wrong with them: where judging starts.

FP8 recipes flush or clip almost nothing of a well-scaled tensor, so the detector's thresholds
(``DetectConfig``: 2 % underflow, 2 % overflow) hold for them. A 4-bit recipe does not: NVFP4's E2M1
values flush about 7 % of a Gaussian's activations (10 % of its weights, in 16x16 blocks), 25-27 %
of a gated product ``SiLU(a) * b`` (the input of a SwiGLU MLP's down projection, the heaviest-tailed
input a healthy transformer gives a linear layer), and its E4M3 block scales, rounded to nearest,
push about 3 % past 6. Judged by FP8's thresholds, every healthy NVFP4 layer would be a false alarm:
a healthy ``transformers`` Llama trained in emulated NVFP4 loses 21 % of its down projections' inputs
at step 5 and 41 % at step 300 (they grow sparser), while NVFP4's faults (block scales flushed under
a tensor scale an outlier set: a massive-activation token, a range wider than the E4M3 scales span)
flush 78-99 %. So a tensor is at fault under a
recipe only beyond the larger of :data:`GAUSSIAN_FACTOR` times what the recipe loses on a standard
normal tensor and :data:`GATED_FACTOR` times what it loses on a gated product (activations and
gradients; weights are never such products), where that is above the detector's own threshold.
The advisor judges each measured recipe this way, and the detector the rows of layers that run
one (an emulated NVFP4 layer logs format ``e2m1``).

The shares are measured by ``emulate.recipe_table.counts`` on 256x256 tensors (seed 0: ``randn``,
then ``silu(randn) * randn``); ``tests/test_recipe_advisor.py`` measures every recipe again and
checks these tables. They are data, not a computation, so that readers (the CLI's report, the
dashboard) need no torch.
"""

from __future__ import annotations

from fp8scope.detect.config import DetectConfig

GAUSSIAN_FACTOR = 3.0
GATED_FACTOR = 2.0
# (recipe, base role) -> (underflow share of the non-zero values, overflow share of the elements); recipes
# and roles not listed lose less than 1e-3 of either (torchao's MXFP8 FLOOR scales push 0.87 % of a
# Gaussian's values past 448, under the detector's 2 %: listed, not needed)
GAUSSIAN: dict[tuple[str, str], tuple[float, float]] = {
    ("nvfp4", "activation"): (0.06876, 0.03421),
    ("nvfp4", "weight"): (0.10126, 0.00278),
    ("nvfp4", "gradient"): (0.06788, 0.03421),  # the expectation under stochastic rounding
    ("mxfp8_floor", "activation"): (0.0, 0.00868),
    ("mxfp8_floor", "weight"): (0.0, 0.00868),
    ("mxfp8_floor", "gradient"): (0.0, 0.00868),
}
GATED: dict[tuple[str, str], tuple[float, float]] = {  # activations and gradients only
    ("nvfp4", "activation"): (0.27261, 0.03337),
    ("nvfp4", "gradient"): (0.25426, 0.03337),  # the expectation under stochastic rounding
    ("mxfp8_floor", "activation"): (0.00012, 0.00652),
    ("mxfp8_floor", "gradient"): (0.00012, 0.00652),
}
# recipe kinds (``Recipe.kind``, ``recipe_table.RECIPES``) whose scales are per block of 16-128 values: an
# outlier costs the values of its own blocks, not the whole tensor's (tests/test_recipe_advisor.py checks
# it against fp8scope.emulate's block recipes)
BLOCK_SCALED = frozenset({"mxfp8", "mxfp8_floor", "block128", "nvfp4"})
# element formats of the tensors table whose rows come from a block recipe, not per-tensor FP8
FORMAT_RECIPE = {"e2m1": "nvfp4"}
FP8 = "fp8"  # any per-tensor FP8 recipe: it loses nothing by design (in no table)


def recipe_of(fmt, kind: str | None) -> str:
    """The recipe a tensors-table row comes from, from its element format ``fmt`` and the recipe kind
    it logged (its ``recipe`` column; None in runs logged before it, and from adapters that do not
    know it): a block recipe's name (NVFP4's ``e2m1`` whatever the kind says), else :data:`FP8`."""
    by_format = FORMAT_RECIPE.get(str(fmt).lower())
    if by_format is not None:
        return by_format
    return kind if kind in BLOCK_SCALED else FP8


def floors(recipe: str, role: str) -> tuple[float, float]:
    """The underflow and overflow shares ``recipe`` may lose on a healthy tensor of ``role``: the
    larger of the factor times each baseline (Gaussian; gated product for activations and gradients)."""
    g_u, g_o = GAUSSIAN.get((recipe, role), (0.0, 0.0))
    p_u, p_o = GATED.get((recipe, role), (0.0, 0.0))
    return (max(GAUSSIAN_FACTOR * g_u, GATED_FACTOR * p_u), max(GAUSSIAN_FACTOR * g_o, GATED_FACTOR * p_o))


def thresholds(recipe: str, role: str, cfg: DetectConfig) -> tuple[float, float]:
    """The underflow and overflow shares from which a tensor is at fault under ``recipe``: the
    detector's (``underflow_warn``, ``underflow_grad_warn`` for gradients, ``sat_warn_fraction``),
    or the recipe's :func:`floors` where they are higher."""
    under, over = floors(recipe, role)
    u = cfg.underflow_grad_warn if role == "gradient" else cfg.underflow_warn
    return max(u, under), max(cfg.sat_warn_fraction, over)
