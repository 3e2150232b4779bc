"""One model worker thread and a bounded queue of generation jobs.

What it is: the only thread that touches the model. Requests become `Job`s; the worker runs
each one's prefill with the chosen method, then stock decode, and streams text deltas back to
the asyncio side as events. A job whose client left is cancelled: skipped if still waiting
(its queue slot is freed at once), stopped at the next token if running. A prefill that has
started runs to its end (a layer loop is not interruptible). What it is not: a batcher.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.generation import StopText, stream_tokens
from ridgefill.methods import Prefill
from ridgefill.models.loading import LoadedModel

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One request on its way through the worker. Events: ("first", ttft_s, meta), ("text", delta),
    ("done", finish_reason, completion_tokens), ("error", status, message)."""

    input_ids: torch.Tensor  # (1, N)
    method: str  # the name the request asked for
    prefill: Prefill  # what it resolved to
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting -> running -> done, or cancelled

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


class Worker:
    """Runs jobs one at a time; at most `max_queue` may wait behind the running one."""

    def __init__(self, lm: LoadedModel, max_queue: int, on_first=None, on_done=None):
        self.lm = lm
        self.max_queue = max_queue
        self.waiting = 0
        self.running = 0
        self._on_first, self._on_done = on_first, on_done
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ridgefill-model", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Admit `job` or raise `QueueFull`. Running and waiting jobs are counted together under one
        lock (a job moving from waiting to running keeps the sum), so however requests race, at
        most 1 + `max_queue` are admitted at a time."""
        with self._lock:
            if self.waiting + self.running > self.max_queue:
                raise QueueFull(f"{self.waiting} requests are waiting (limit {self.max_queue}); retry later")
            self.waiting += 1
        self._jobs.put(job)

    def cancel(self, job: Job) -> None:
        with self._lock:
            if job.state == "waiting":
                self.waiting -= 1
            if job.state in ("waiting", "running"):
                job.state = "cancelled"

    def close(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while (job := self._jobs.get()) is not None:
            with self._lock:
                if job.state == "cancelled":
                    continue
                self.waiting -= 1
                self.running = 1
                job.state = "running"
            try:
                self._run(job)
            except RidgefillError as e:
                job.emit("error", 400, str(e))
            except Exception:  # a bug: log it, answer 500, keep serving
                log.exception("generation failed")
                job.emit("error", 500, "internal error while generating; see the server log")
            finally:
                with self._lock:
                    self.running = 0
                    if job.state == "running":
                        job.state = "done"

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        pre = job.prefill.run(Engine(self.lm), job.input_ids)
        out = StopText(self.lm, job.stop)
        finish = "length"
        for tok in stream_tokens(self.lm, job.input_ids, pre, job.max_tokens, job.temperature, job.top_p, job.seed):
            if not out.tokens:
                ttft = time.perf_counter() - t0
                meta = {"method": job.method, "ran_exact": pre.ran_exact}
                job.emit("first", ttft, meta)
                if self._on_first:
                    self._on_first("exact" if meta["ran_exact"] else job.method, ttft)
            if job.state == "cancelled":
                finish = "cancelled"
                break
            if delta := out.push(tok):
                job.emit("text", delta)
            if out.finish:
                finish = out.finish
                break
        if delta := out.rest():
            job.emit("text", delta)
        job.emit("done", finish, len(out.tokens))
        if self._on_done:
            self._on_done(int(job.input_ids.shape[1]), len(out.tokens))
