"""Our own prefill loop over the model's layers."""

from ridgefill.engine.core import Engine, LowerState, Plan, PrefillResult, merge_by_position

__all__ = ["Engine", "LowerState", "Plan", "PrefillResult", "merge_by_position"]
