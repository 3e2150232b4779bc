"""Our own prefill loop over the model's layers."""

from ridgefill.engine.core import Engine, LowerState, PrefillResult, merge_by_position

__all__ = ["Engine", "LowerState", "PrefillResult", "merge_by_position"]
