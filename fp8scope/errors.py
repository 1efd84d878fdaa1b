"""Errors that carry a one-line message meant for the user (the CLI prints it and exits non-zero)."""


class Fp8ScopeError(Exception):
    """Base class: str(exc) is a complete one-line explanation, no traceback needed."""


class RunError(Fp8ScopeError):
    """A run folder is missing, malformed, or of an unknown schema version."""


class UsageError(Fp8ScopeError):
    """Bad arguments from the user (CLI flags, API parameters)."""
