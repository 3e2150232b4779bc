"""Every evaluation task by name: RULER's (ruler.py) and the pass-key test (passkey.py)."""

from __future__ import annotations

from collections.abc import Sequence

from ridgefill.errors import RidgefillError
from ridgefill.eval import passkey, ruler

TASKS = (*ruler.TASKS, passkey.NAME)


def make_task(name: str, essay: Sequence[str]):
    """The `api.Task` called `name`, its haystack sentences (where it reads any) from `essay`."""
    if name == passkey.NAME:
        return passkey.PasskeyTask(essay)
    if name not in ruler.TASKS:
        raise RidgefillError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return ruler.RulerTask(name, tuple(essay))
