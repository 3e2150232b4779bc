"""lm-evaluation-harness model type `ridgefill`: the harness's requests through our prefill.

What it is: `RidgefillLM`, registered as `--model ridgefill` when this module is imported
(`python -m ridgefill.integrations.lmeval run ...` imports it, then runs the harness's own CLI).
model_args: `pretrained` (a short name, HF folder or .gguf), `method` (any method name or
`tuned`; default `tuned` where the model has a tuned configuration, else exact), `maps` (a map file
or folder; default the model's cache folder, fitted on first use), `dtype` and `device` (auto), and
any setting of the method by name (`split`, `sink`, `tail`, `query_rows`, ...), checked as
everywhere (methods/resolve.py).

How scoring meets the fill: only rows that run every layer have logits. So the scored tokens of
a request always run fully: a continuation of up to `tail - 1` tokens is the tail of one
prefill; a longer one (and `loglikelihood_rolling`) is scored in chunks of `tail - 1` tokens,
each the tail of a prefill of everything before it, so the context is filled and the scored
tokens are exact rows, as in `ridgefill eval`'s tail perplexity. With `exact` every chunk is the
whole window at once. `generate_until` prefills with the method, then decodes with the stock
model, stopping at the request's `until` strings. Batch size 1.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (the harness fills its registry lazily only while it is empty)
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.generation import StopText, stream_tokens
from ridgefill.methods import resolve_prefill
from ridgefill.methods.resolve import parse_method
from ridgefill.models import load_model


def _typed(value: object) -> object:
    """A model_args value as the harness may hand it over (a string): numbers and `none` parsed;
    the resolver then checks each against its settings field."""
    if not isinstance(value, str):
        return value
    if value.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@register_model("ridgefill")
class RidgefillLM(TemplateLM):
    def __init__(
        self,
        pretrained: str = "smollm2-135m",
        method: str | None = None,
        maps: str | None = None,
        dtype: str = "auto",
        device: str | None = "auto",
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **settings: object,
    ):
        super().__init__()
        if str(batch_size) not in ("1", "auto"):
            raise RidgefillError("the ridgefill model type runs batch size 1")
        if method is not None:
            parse_method(method)  # an unknown method fails before the model loads
        # The harness passes model_args as strings: each setting is typed by the method's settings field.
        typed = {k: _typed(v) for k, v in settings.items()}
        self.lm = load_model(pretrained, dtype=dtype, device=device or "auto")
        self.tokenizer = self.lm.tokenizer
        self.prefill = resolve_prefill(self.lm, method, maps=maps, **typed)
        self.method = self.prefill.label  # as asked (`tuned` may run a different method per length)
        self.engine = Engine(self.lm)

    # ----- what TemplateLM needs -----

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.lm.context_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", self.lm.name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: object) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ----- scoring -----

    @torch.inference_mode()
    def score(self, ids: list[int], start: int) -> tuple[float, bool]:
        """Sum of log p(ids[t] | ids[:t]) for t >= start, and whether every one was the argmax."""
        n = len(ids)
        tails = [p.settings.tail for p in self.prefill.variants if p.settings is not None]
        step = max(1, min(tails) - 1) if tails else n
        total, greedy = 0.0, True
        for a in range(max(1, start), n, step):
            b = min(n, a + step)  # targets ids[a:b], read from rows a-1 .. b-2 of the prefix ids[:b]
            x = torch.tensor([ids[:b]])
            res = self.prefill.run(self.engine, x, logit_rows=torch.arange(a - 1, b - 1))
            target = x[0, a:b].to(res.logits.device)
            logp = F.log_softmax(res.logits.float(), dim=-1)
            total += float(logp.gather(1, target[:, None]).sum())
            greedy &= bool((res.logits.argmax(-1) == target).all())
        return total, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_: object) -> list[tuple[float, bool]]:
        out = []
        for _, context, continuation in tqdm(requests, desc=f"loglikelihood ({self.method})", disable=disable_tqdm):
            ids = (context + continuation)[-self.max_length :]  # left-truncated, as the harness does
            out.append(self.score(ids, len(ids) - len(continuation)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in tqdm([r.args for r in requests], desc=f"rolling ({self.method})", disable=disable_tqdm):
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            out.append(sum(self.score(ctx + cont, len(ctx))[0] for ctx, cont in windows))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm(
            [r.args for r in requests], desc=f"generate ({self.method})", disable=disable_tqdm
        ):
            kw = dict(gen_kwargs)
            until = kw.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            x = torch.tensor([ids])
            pre = self.prefill.run(self.engine, x)
            answer = StopText(self.lm, until)
            for tok in stream_tokens(self.lm, x, pre, max_new, temperature, 1.0, 1234):
                answer.push(tok)
                if answer.finish:
                    break
            out.append(answer.text)
        return out


def main() -> None:
    """The harness's own CLI with the `ridgefill` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
