"""The shadow steps' tables, registered with the store when this module is imported.

Readers do not need this import: every Arrow IPC stream starts with its own schema
message, so ``load_run(...).table("shadow_compare")`` decodes a run's shadow rows
without knowing the schema in advance. The registration matters to the writer (the
store refuses unknown tables) and to readers asking for a table a run never wrote
(the empty table with the right columns); ``import fp8scope.shadow`` gives both.
"""

from __future__ import annotations

import pyarrow as pa

from fp8scope.schema import SCHEMA_VERSION, register_table

COMPARE_TABLE = "shadow_compare"
FORK_TABLE = "shadow_fork"


def _meta(name: str) -> dict:
    return {b"fp8scope.table": name.encode(), b"fp8scope.schema_version": str(SCHEMA_VERSION).encode()}


# One row per compared layer per compare step. FP8 side = the real training step;
# BF16 side = the same step re-run with FP8 off (same weights, batch, RNG).
# rel_err = ||fp8 - bf16|| / ||bf16||; cos = <fp8, bf16> / (||fp8|| ||bf16||).
SHADOW_COMPARE_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("layer", pa.string()),
        ("output_rel_err", pa.float64()),  # end to end: the layer's output in the FP8 step vs the BF16 pass
        ("output_cos", pa.float64()),
        ("wgrad_rel_err", pa.float64()),  # weight gradient of the FP8 step vs the BF16 pass
        ("wgrad_cos", pa.float64()),
        ("local_rel_err", pa.float64()),  # this layer's own FP8 GEMM on the BF16 input (null if unknown)
        ("local_cos", pa.float64()),
        ("loss_fp8", pa.float64()),
        ("loss_bf16", pa.float64()),
        ("sampled", pa.bool_()),  # stats estimated on a fixed random sample of elements (large tensors)
    ],
    metadata=_meta(COMPARE_TABLE),
)

# One row per step of a fork (the FP8 run and its BF16 replica on the same batch).
# The fork's verdict is the one in its last row (highest step): "pending" until then.
SHADOW_FORK_SCHEMA = pa.schema(
    [
        ("fork_id", pa.int32()),
        ("start_step", pa.int64()),
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("loss_fp8", pa.float64()),
        ("loss_bf16", pa.float64()),
        ("baseline", pa.float64()),  # pre-fork loss the divergence test compares against
        ("verdict", pa.string()),  # pending / fp8-induced / not-fp8 / inconclusive
        ("reason", pa.string()),
        ("trigger", pa.string()),  # what started the fork: manual / every / event: ...
    ],
    metadata=_meta(FORK_TABLE),
)

register_table(COMPARE_TABLE, SHADOW_COMPARE_SCHEMA)
register_table(FORK_TABLE, SHADOW_FORK_SCHEMA)
