"""User-facing errors.

Every error a user can cause (bad model name, corrupt file, prompt too long, wrong maps) is a
`RidgefillError`: the CLI prints its message and exits non-zero without a traceback. Anything
else that escapes is a bug.
"""

from collections.abc import Iterable


class RidgefillError(Exception):
    """An error caused by input, with a message that says what to do."""


class UnknownModelError(RidgefillError):
    """A model name that is neither a known short name, a directory, nor a GGUF file."""


class UnsupportedArchitectureError(RidgefillError):
    """A checkpoint whose architecture the engine does not implement."""


class PromptError(RidgefillError):
    """An empty prompt, or one that does not fit in the model's context."""


class MapError(RidgefillError):
    """A map file that is corrupt, non-finite, or fitted on another model."""


def check_lengths(lengths: Iterable[int], name: str, context_length: int) -> None:
    """Raise `PromptError` for the first length above the model's context (eval, bench and ppl
    call it before any work, so a bad length loses nothing)."""
    for n in lengths:
        if n > context_length:
            raise PromptError(f"length {n} exceeds {name}'s context of {context_length}")
