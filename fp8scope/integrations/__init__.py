"""Framework integrations, each imported on demand (optional extras):

- ``fp8scope.integrations.hf.Fp8ScopeCallback``: ``transformers.Trainer`` (extra ``[hf]``).
- ``fp8scope.integrations.lightning.Fp8ScopeCallback``: PyTorch Lightning (extra ``[lightning]``).
- a plain loop needs nothing more than ``Monitor`` (gradient accumulation and activation
  checkpointing are handled there; docs/integrations.md).

Nothing here is imported by ``import fp8scope``.
"""
