"""The fused full-stats form as inductor compiles it, against the eager form.

Wherever the stats compile the fused form (``capture.stats._make_full_fused``) is what runs;
``tests/test_stats.py`` checks its arithmetic eagerly, and ``tests/test_gpu.py`` compiled to Triton
where a GPU is lent.
Here inductor compiles it with the variant's own options (realize thresholds; no split reductions
but with other recipes in the same graph) to C++, on adversarial tensors (NaN, Inf, zeros,
subnormals, values past the format's range), so a lowering that changes a number (NaN through a
max, the minima's negation, float64 sums) fails without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from fp8scope.capture import stats as st
from tests.conftest import assert_same_row, fused_stats_case


@pytest.mark.parametrize("variant", ["per_tensor", "deq", "per_row", "recipes", "per_row_recipes"])
def test_the_fused_form_compiled_gives_the_eager_numbers(variant):
    g = torch.Generator().manual_seed(0)
    cases = [fused_stats_case(variant, "e4m3", 64, 200, trial, g) for trial in range(6)]
    key = cases[0][0]  # one variant: the same key for every case
    options = st._compile_options(("cuda", *key[1:]))  # the options the variant compiles with on a GPU
    # the rows are the split, except where the other recipes' whole-tensor reductions need inductor's
    assert options is not None and options.get("split_reductions", True) is variant.endswith("recipes")
    compiled = torch.compile(st._make_full_fused(key), dynamic=True, options=options)
    eager = st._make_full(key)
    for trial, (_, args) in enumerate(cases):
        with torch.no_grad():  # as fp8scope.compiled runs it
            got, want = compiled(*args), eager(*args)
        if variant.endswith("recipes"):
            assert torch.allclose(got[1], want[1], rtol=1e-9, equal_nan=True), (trial, got[1], want[1])
            got, want = got[0], want[0]
        assert_same_row(got, want, 1e-9, variant, trial)


def test_the_recipes_fused_sums_give_the_eager_counts():
    """``recipe_table.counts(fused=True)`` (the seven sums per row, then over the rows: the form compiled
    on a GPU) and the eager form (each column reduced alone): the same vector for every recipe and role,
    NVFP4 gradients' expectations included, on a tensor with NaN, Inf, zeros and subnormals."""
    from fp8scope.emulate.recipe_table import RECIPES, counts
    from fp8scope.schema import RECIPE_FIELDS

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-10, 5, 256)
    x[0, 0], x[1, 1], x[2, 2], x[3, :7] = math.nan, math.inf, -math.inf, 0.0
    x[4, 4] = 1e-42
    for recipe in RECIPES:
        for role in ("activation", "weight", "gradient"):
            fused, eager = counts(x, recipe, role, fused=True), counts(x, recipe, role)
            assert fused.shape == eager.shape == (len(RECIPE_FIELDS),), (recipe, role)
            expected = ("underflow", "saturated") if recipe == "nvfp4" and role == "gradient" else ()  # expectations
            exact = [i for i, f in enumerate(RECIPE_FIELDS) if not f.startswith("sq_") and f not in expected]
            assert torch.equal(fused[exact], eager[exact]), (recipe, role, fused, eager)
            assert torch.allclose(fused, eager, rtol=1e-9, equal_nan=True), (recipe, role, fused, eager)


def test_the_amax_pair_fused_form_compiled_gives_the_eager_amaxes():
    """The emulated layer's amax pair as a GPU compiles it (``amax._fused_pair``, each row then the
    rows, with ``AMAX``'s options), compiled here to C++: TE's recorded amax ignores NaN, the logged
    one keeps it, and Inf stays Inf in both, on the matrix views ``row_matrix`` makes and on the
    layer's own tensors, as a user's compiled model traces it (an H100 found the form reducing a
    (batch, tokens, features) activation along tokens: too many values to unpack)."""
    from fp8scope.emulate import amax

    compiled = torch.compile(amax._fused_pair, dynamic=True, options=amax.AMAX.options(("cuda", torch.bfloat16)))
    g = torch.Generator().manual_seed(2)
    for trial, planted in enumerate([math.nan, math.inf, -math.inf, 0.0, 1e-40, -3e4]):
        x = torch.randn(3, 40, 256, generator=g) * 10 ** (trial - 3)
        x[trial % 3, 7, trial] = planted
        for shaped in (x, x.reshape(-1)):  # a batch of activations; a vector, refolded into rows
            view = amax.row_matrix(shaped)
            assert view.dim() == 2 and view.shape[0] >= 64, view.shape
            for traced in (view, shaped, shaped[trial % 3, 7, trial] if shaped.dim() == 3 else shaped[:1]):
                with torch.no_grad():
                    got, want = compiled(traced), amax.amaxes_of(traced)
                for g_, w_ in zip(got, want):
                    assert g_.shape == () and g_.dtype == w_.dtype == torch.float32, (traced.shape, got)
                    assert torch.equal(g_, w_) or (g_.isnan() and w_.isnan()), (planted, got, want)


def test_row_matrix_views_any_tensor_as_rows():
    from fp8scope.emulate.amax import row_matrix

    assert row_matrix(torch.zeros(4, 32, 64)).shape == (128, 64)  # leading dims flattened
    assert row_matrix(torch.zeros(1 << 20)).shape == (256, 4096)  # a vector refolded
    assert row_matrix(torch.zeros(8, 1 << 16)).shape == (128, 4096)  # too few rows: refolded
    assert row_matrix(torch.zeros(8, 1000)).shape == (8, 1000)  # no fold that divides: kept
    assert row_matrix(torch.zeros(())).shape == (1, 1)
    x = torch.randn(6, 7, 8)
    assert row_matrix(x).data_ptr() == x.data_ptr()  # a view, no copy
