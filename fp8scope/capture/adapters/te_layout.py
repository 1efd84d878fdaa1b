"""What differs between Transformer Engine versions, as data: one :class:`TeLayout` per version.

Every fact was read from TE's source at the tag named (``git show vX.Y:path``; file:line below, paths
under ``transformer_engine/``). Nothing here imports TE, so the tests build stand-ins per version
against the same table and TE's own layout is checked on a GPU by ``examples/te_hopper.py``.

- **LayerNormMLP backward slots** (``pytorch/module/layernorm_mlp.py``): three layouts.
  - v2.0-2.2: the module hands its backward quantizers to ``_LayerNormMLP.forward`` in another order
    than its signature (v2.0 lines 119-121 vs 1404-1406), so fc2's grad_output uses slot 3
    (GRAD_INPUT2) and fc1's hidden gradient slot 1 (GRAD_INPUT1).
  - v2.3: fc2 slot 0 (GRAD_OUTPUT1), fc1 slot 1 (v2.3 lines 1764-1769; commit beaecf84e).
  - v2.4+: fc2 slot 2 (GRAD_OUTPUT2), fc1 slot 0 (GRAD_OUTPUT1) (v2.4 lines 1880-1885; commit
    ce0b46c4d); slots 1 and 3 stay unused.
  Forward slots are the same in every version: fc1 input 0, fc1 weight 1, fc2 input 3, fc2 weight 4
  (``pytorch/csrc/common.h``, ``FP8FwdTensors``).
- **GroupedLinear slots** (``pytorch/module/grouped_linear.py``): blocked in v2.0-2.2 (input i,
  weight n+i, grad_output i; v2.0 line 456), interleaved from v2.3 (3i, 3i+1, 2i; v2.3 lines 525-529).
- **Current-scaling quantizer buffers**: ``Float8CurrentScalingQuantizer.scale`` / ``.amax`` hold the
  latest cast's values in 2.2-2.15 (``pytorch/tensor/float8_tensor.py``, v2.8 lines 241-248); from
  2.16 they are per-call temporaries (``pytorch/csrc/quantizer.cpp``, v2.16 lines 931-936).
- **The backward-update flag of ``_Linear``**: on the autograd node (``ctx``) up to 2.15; from 2.16
  on ``ctx.backward_objects`` (``pytorch/module/linear.py``, v2.16 lines 1298-1304), cleared by the
  backward. The other modules keep it on ``ctx`` in every version.
- **MXFP8 code 0**: before 2.13 a block whose E8M0 code is 0 is multiplied by 1 before the cast
  (``common/util/ptx.cuh``, v2.8 lines 114-118); from 2.13 by 2^127 (v2.16 lines 337-346).
- **NVFP4 block scale**: ``e4m3(block_amax / 6 * S_enc)`` in 2.8-2.13 (``common/util/nvfp4_transpose.cuh``
  v2.8 line 124; ``common/cast/nvfp4/core_nvfp4.cuh`` v2.12 and v2.13 line 50), ``e4m3(block_amax *
  (S_enc * (1/6)))`` from 2.14 (v2.14 and v2.18 line 51): the two roundings of the product can differ
  by one float32 ulp, and so now and then by one E4M3 step of a block's scale.
- ``NVFP4BlockScaling``'s switches: ``disable_rht``, ``disable_stochastic_rounding`` and
  ``disable_2d_quantization`` in every version that has the recipe (``common/recipe/__init__.py`` v2.8
  lines 412-416); ``row_scaled_activation`` from 2.16 (v2.16 line 538) and ``nvfp4_4over6`` from 2.17
  (v2.17 line 554), both off by default.
- Recipes: ``Float8CurrentScaling`` from 2.2, ``Float8BlockScaling`` from 2.3, ``NVFP4BlockScaling``
  from 2.8, ``CustomRecipe`` from 2.12 (``common/recipe/__init__.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST = (2, 0)  # the first version whose layout is read here
NEWEST_READ = (2, 20)  # the newest version whose source was read (main, 2.20.0.dev0)


@dataclass(frozen=True)
class TeLayout:
    version: tuple[int, int]
    mlp_grad_slots: tuple[int, int]  # backward slots of (fc1's hidden gradient, fc2's grad_output)
    grouped_interleaved: bool  # GroupedLinear: 3i / 3i+1 / 2i (else i / n+i / i)
    current_buffers: bool  # Float8CurrentScalingQuantizer keeps .scale / .amax after a cast
    linear_flag_on_args: bool  # _Linear's backward-update flag lives on ctx.backward_objects
    mx_code0_is_one: bool  # MXFP8: a code-0 block is multiplied by 1 before the cast
    nvfp4_divides_first: bool  # NVFP4: a block's scale is e4m3(amax / 6 * S_enc), not e4m3(amax * (S_enc / 6))

    def grouped_slots(self, i: int, n: int) -> tuple[int, int, int]:
        """GroupedLinear GEMM ``i`` of ``n``: (input, weight, grad_output) slots."""
        return (3 * i, 3 * i + 1, 2 * i) if self.grouped_interleaved else (i, n + i, i)


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a TE version string (``2.18.0``, ``2.20.0.dev0+d0067d0``), None if unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(text or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def layout_for(version: tuple[int, int]) -> TeLayout:
    """The layout of TE ``version`` (versions before 2.0 get 2.0's: the caller warns)."""
    v = max(version, OLDEST)
    if v < (2, 3):
        mlp = (1, 3)
    elif v < (2, 4):
        mlp = (1, 0)
    else:
        mlp = (0, 2)
    return TeLayout(
        version=version,
        mlp_grad_slots=mlp,
        grouped_interleaved=v >= (2, 3),
        current_buffers=(2, 2) <= v < (2, 16),
        linear_flag_on_args=v >= (2, 16),
        mx_code0_is_one=v < (2, 13),
        nvfp4_divides_first=v < (2, 14),
    )


def installed_version() -> tuple[int, int] | None:
    """The imported TE's (major, minor): ``transformer_engine.__version__`` (every 2.x sets it from
    its package metadata, ``transformer_engine/__init__.py``), else the metadata itself."""
    import sys

    te = sys.modules.get("transformer_engine")
    v = parse_version(getattr(te, "__version__", "")) if te is not None else None
    if v is None:
        try:
            from importlib.metadata import version

            v = parse_version(version("transformer_engine"))
        except Exception:
            v = None
    return v
