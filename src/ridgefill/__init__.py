"""ridgefill: faster LLM prefill without training.

import ridgefill
lm = ridgefill.load_model("smollm2-135m")
print(ridgefill.generate(lm, "Summarise ...", method="exact").text)
"""

from ridgefill.engine import Engine, PrefillResult
from ridgefill.errors import RidgefillError
from ridgefill.generation import GenerationResult, encode_prompt, generate
from ridgefill.models import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, load_model
from ridgefill.patch import patch, patch_state, unpatch

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "Engine",
    "GenerationResult",
    "LoadedModel",
    "PrefillResult",
    "RidgefillError",
    "encode_prompt",
    "generate",
    "load_model",
    "patch",
    "patch_state",
    "unpatch",
]
