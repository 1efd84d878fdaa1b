"""fp8scope: why an FP8 training run is unstable, where, and whether FP8 is to blame."""

__version__ = "0.1.0"
