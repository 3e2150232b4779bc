"""`ridgefill serve`: an OpenAI-compatible HTTP server whose prefill is ours.

What it is: FastAPI routes (`app.py`) over one model worker thread with a bounded queue
(`worker.py`), OpenAI request/response shapes, validation and errors (`protocol.py`), the
checks that need the model and its tokenizer (`prepare.py`), Host/API-key/size checks
(`guard.py`), Prometheus metrics (`metrics.py`). What it is not: a batcher; this is batch 1,
one request on the model at a time.
"""

from ridgefill.serve.app import ServeConfig, create_app
from ridgefill.serve.guard import Security

__all__ = ["Security", "ServeConfig", "create_app"]
