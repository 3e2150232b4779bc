"""ridgefill: faster LLM prefill without training.

import ridgefill
lm = ridgefill.load_model("smollm2-135m")            # dtype and device: auto
print(ridgefill.generate(lm, "Summarise ...").text)  # the tuned method where the model has one
"""

from ridgefill.engine import Engine, Plan, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.generation import GenerationResult, encode_prompt, generate
from ridgefill.methods import METHODS, FillSettings, GateSettings, Prefill, resolve_prefill
from ridgefill.models import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, load_model
from ridgefill.patch import patch, patch_state, unpatch

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "METHODS",
    "Engine",
    "FillSettings",
    "GateSettings",
    "GenerationResult",
    "LoadedModel",
    "Plan",
    "Prefill",
    "PrefillResult",
    "RidgefillError",
    "encode_prompt",
    "generate",
    "load_model",
    "patch",
    "patch_state",
    "resolve_prefill",
    "unpatch",
]
