"""Column layout shared by the capture side and the store: the contract between them.

Capture packs each monitored tensor's numbers into one float64 vector laid out as
``STAT_FIELDS`` (so a whole step's stats stack into one device tensor and move to the
host in one transfer). The store turns those vectors into Arrow record batches with
``TENSOR_SCHEMA``. Both sides import from here; neither imports the other.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

# Tensor roles, Transformer Engine's words.
ROLES = ("activation", "weight", "gradient", "output")
DEFAULT_ROLES = ("activation", "weight", "gradient")


def base_role(tensor: str) -> str:
    """The role of a logged tensor name. A framework that casts one role twice, along different
    axes for different GEMMs (torchao's rowwise recipes), logs the second cast as
    ``role@axis`` (``gradient@dim1``); rules and filters treat it as its role."""
    return tensor.partition("@")[0]


def simulated_casts(sources) -> list[bool]:
    """Per tensor of a run, from each one's ``source``: whether its FP8 casts are simulated where the
    run's other tensors are real FP8. A what-if tensor beside FP8 layers belongs to a layer kept in
    high precision (an output head, first and last blocks): its scale, range and flush are what the
    what-if recipe would do, never the run's FP8 trouble. In a run without FP8 layers every tensor
    is what-if, and the report says so for the whole run instead (False here)."""
    sources = list(sources)
    real = any(s not in (None, "whatif") for s in sources)
    return [real and s == "whatif" for s in sources]


# Per-tensor stats vector computed on the device. "merge" says how two captures of the same
# tensor within one step (gradient-accumulation micro-batches) combine on the host.
STAT_FIELDS: tuple[tuple[str, str], ...] = (
    ("amax", "max"),
    ("min_nonzero", "min"),  # smallest non-zero |x|: lower end of the dynamic range
    ("numel", "sum"),
    ("zeros", "sum"),
    ("nonfinite", "sum"),
    ("overflow", "sum"),  # |x * scale| > fp8_max, counted before the cast
    ("underflow", "sum"),  # non-zero before the cast, zero after
    # of those, the ones 4 binades or more under the flush threshold (formats.deep_underflow_threshold):
    # a tail of near-zero values, not a bulk the scale pressed under (detect's underflow rule)
    ("underflow_deep", "sum"),
    # non-zero, and under the format's smallest normal: flushed, or a subnormal with fewer mantissa bits
    # than the format's. Where the bulk sits: a scale pressed under by an outlier puts a large part of
    # the tensor there, a tail of small values that crosses the flush threshold only a few % (the
    # underflow rule tells the two apart by it)
    ("below_normal", "sum"),
    ("saturated", "sum"),  # quantized to +-fp8_max (clipped or rounded onto the top code)
    ("sq_err", "sum"),  # sum (dequant(quant(x)) - x)^2 over finite elements
    ("sq_signal", "sum"),  # sum x^2 over finite elements, for SQNR
    ("scale", "last"),
    ("scale_inv", "last"),
    ("expected_amax", "last"),  # the amax the recipe derived the scale from
)
FIELD_INDEX = {name: i for i, (name, _) in enumerate(STAT_FIELDS)}
N_FIELDS = len(STAT_FIELDS)
# Fields that only full stats fill; cheap stats leave them NaN (null in the store).
FULL_ONLY = ("min_nonzero", "zeros", "nonfinite", "overflow", "underflow", "underflow_deep", "below_normal",
             "saturated", "sq_err", "sq_signal")

TENSOR_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("layer", pa.string()),
        ("tensor", pa.string()),  # role: activation / weight / gradient / output
        ("order", pa.int32()),  # execution order of the first capture within the step
        ("source", pa.string()),  # emulated / torchao / te / whatif
        ("fp8_format", pa.string()),  # e4m3 / e5m2 / ...
        # the recipe kind its scales come from (delayed / current / rowwise / mxfp8 / block128 / nvfp4;
        # a what-if row's is the simulated recipe's); null where the adapter does not know it. Rules
        # that reason about one scale per tensor read it (detect.design_loss.BLOCK_SCALED)
        ("recipe", pa.string()),
        ("full", pa.bool_()),  # full stats (True) or cheap stats (amax and scales only)
        ("calls", pa.int32()),  # captures merged into this row (micro-batches)
        ("amax", pa.float64()),
        ("min_nonzero", pa.float64()),
        ("scale", pa.float64()),
        ("scale_inv", pa.float64()),
        ("expected_amax", pa.float64()),
        ("fp8_max", pa.float64()),
        ("numel", pa.int64()),
        ("zeros", pa.int64()),
        ("nonfinite", pa.int64()),
        ("overflow", pa.int64()),
        ("underflow", pa.int64()),
        # null in a run logged before it existed: readers then judge all of the underflow as shallow
        ("underflow_deep", pa.int64()),
        # null in a run logged before it existed: the underflow rule then judges the flush as before
        ("below_normal", pa.int64()),
        ("saturated", pa.int64()),
        ("qerr_mse", pa.float64()),
        ("sqnr_db", pa.float64()),
    ],
    metadata={b"fp8scope.table": b"tensors", b"fp8scope.schema_version": str(SCHEMA_VERSION).encode()},
)

SCALAR_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("name", pa.string()),
        ("value", pa.float64()),
        ("time", pa.float64()),  # wall-clock seconds since the epoch when the step ended
    ],
    metadata={b"fp8scope.table": b"scalars", b"fp8scope.schema_version": str(SCHEMA_VERSION).encode()},
)

EVENT_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("rule", pa.string()),
        ("severity", pa.string()),  # info / warning / critical
        ("layer", pa.string()),
        ("tensor", pa.string()),
        ("value", pa.float64()),
        ("threshold", pa.float64()),
        ("message", pa.string()),
    ],
    metadata={b"fp8scope.table": b"events", b"fp8scope.schema_version": str(SCHEMA_VERSION).encode()},
)

# Other recipes measured on the same tensors (``Monitor(whatif_recipes=...)``, ``capture.stats``):
# long, one row per (step, tensor, recipe), so a recipe is one more dimension for readers and SQL.
RECIPE_FIELDS = ("numel", "nonzero", "underflow", "underflow_deep", "overflow", "saturated", "sq_err", "sq_signal",
                 "clip_ratio")
RECIPE_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("layer", pa.string()),
        ("tensor", pa.string()),
        ("recipe", pa.string()),
        ("numel", pa.int64()),
        ("nonzero", pa.int64()),
        ("underflow", pa.int64()),
        ("underflow_deep", pa.int64()),  # as the tensors table's (null in a run logged before it existed)
        ("overflow", pa.int64()),
        ("saturated", pa.int64()),
        ("sq_err", pa.float64()),
        ("sq_signal", pa.float64()),
        ("sqnr_db", pa.float64()),
        ("clip_ratio", pa.float64()),  # the largest |x * scale| / the format's max: > 1 clips
    ],
    metadata={b"fp8scope.table": b"recipes", b"fp8scope.schema_version": str(SCHEMA_VERSION).encode()},
)

TABLE_SCHEMAS = {"tensors": TENSOR_SCHEMA, "scalars": SCALAR_SCHEMA, "events": EVENT_SCHEMA, "recipes": RECIPE_SCHEMA}
# what a row of each table is about, beyond its (rank, step): a stream without these columns cannot be
# placed by any reader (the store refuses it)
TABLE_KEYS = {"tensors": ("layer", "tensor"), "recipes": ("layer", "tensor", "recipe"), "scalars": ("name",),
              "events": ("rule",)}


def register_table(name: str, schema: pa.Schema) -> None:
    """Let a later stage (shadow steps, detection) add a table the store writes and reads like the others."""
    TABLE_SCHEMAS[name] = schema
