"""One-pass closed-form ridge fit of fill maps, for several splits at once.

What it is: stream calibration segments through the exact engine, keep float64 sufficient
statistics (X^T X and X^T Y, X the split state with a bias column; Y each deeper layer's input
for `ridge`, or its pre-RoPE K and V for `kva`), then solve for every split and choose lambda
per layer on held-out segments. Rows that break a linear fit are left out (see `fit_rows`).
What it is not: a trainer; there is no gradient step anywhere.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.fit.maps import MAP_METHODS, FillMaps, fingerprint
from ridgefill.models.loading import LoadedModel
from ridgefill.ops.norm import rms_normed


@dataclass(frozen=True)
class FitConfig:
    """What to fit and on how much text.

    Attributes:
        splits: candidate split layers; all are accumulated in the same pass.
        methods: "ridge" (predict deep inputs) and/or "kva" (predict deep K/V).
        segment_tokens: tokens per calibration segment (each starts at position 0).
        alphas: lambda grid, relative to the mean diagonal of X^T X.
        skip_first: the first rows of each segment (attention sinks) are left out of the fit.
        outlier_factor: rows whose split-state norm exceeds this many times the segment's median
            (massive activations) are left out of the fit; the fill runs them as full rows.
        normed_targets: ridge predicts each deep input divided by its RMS. Every deep layer
            reads its input through an RMSNorm, which ignores scale, so only the direction
            matters; fitting it keeps a few large-norm rows and channels from dominating the loss.
        facts: retrieval-like key-value facts spliced into each calibration segment (fit/facts.py);
            0 fits on the text as it is.
    """

    splits: tuple[int, ...] = (10, 15, 20)
    methods: tuple[str, ...] = MAP_METHODS
    segment_tokens: int = 2048
    alphas: tuple[float, ...] = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
    skip_first: int = 4
    outlier_factor: float = 8.0
    normed_targets: bool = True
    facts: int = 0


def fit_rows(h_split: torch.Tensor, skip_first: int, outlier_factor: float) -> torch.Tensor:
    """Boolean (T,) mask of rows a linear map can fit: not a sink, not a massive activation.

    Args:
        h_split: (T, d) split-layer states of one segment (or prompt).
    """
    norms = h_split.float().norm(dim=-1)
    keep = norms <= outlier_factor * norms.median()
    keep[:skip_first] = False
    return keep


@dataclass
class _Stats:
    """float64 sufficient statistics for one split: X^T X, X^T Y, and sum Y^2 per layer block."""

    xtx: torch.Tensor  # (d+1, d+1)
    xty: dict[str, torch.Tensor]  # method -> (d+1, L_deep * out)
    yy: dict[str, torch.Tensor] = field(default_factory=dict)  # method -> (L_deep,)
    identity_sq: torch.Tensor | None = None  # (L_deep,) squared error of the identity fill (ridge)
    rows: int = 0

    def add(self, x: torch.Tensor, ys: dict[str, torch.Tensor], block: dict[str, int], normed: bool) -> None:
        x, ys = x.cpu(), {m: y.cpu() for m, y in ys.items()}  # float64 statistics live on the CPU
        if "ridge" in ys:  # identity predicts every deep input as the split state (same space as Y)
            x_id = (rms_normed(x) if normed else x).double().repeat(1, ys["ridge"].shape[1] // x.shape[1])
            sq = ((ys["ridge"].double() - x_id) ** 2).sum(0).view(-1, x.shape[1]).sum(1)
            self.identity_sq = sq if self.identity_sq is None else self.identity_sq + sq
        xa = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        self.xtx += xa.T @ xa
        for m, y in ys.items():
            y = y.double()
            self.xty[m] += xa.T @ y
            sq = (y * y).sum(0).view(-1, block[m]).sum(1)
            self.yy[m] = self.yy.get(m, torch.zeros_like(sq)) + sq
        self.rows += x.shape[0]


def _targets(engine: Engine, states: list[torch.Tensor], split: int, cfg: FitConfig, rows) -> dict:
    """Y per method for deep layers split+1..L-1, rows selected: (R, L_deep * out)."""
    num_layers = engine.parts.num_layers
    methods = cfg.methods
    out = {}
    if "ridge" in methods:
        ys = [states[i][0, rows] for i in range(split + 1, num_layers)]
        out["ridge"] = torch.cat([rms_normed(y) for y in ys] if cfg.normed_targets else ys, dim=1)
    if "kva" in methods:
        cols = []
        for i in range(split + 1, num_layers):
            k, v = engine.pre_rope_kv(i, engine.parts.layers[i].input_norm(states[i][:, rows]))
            cols += [k[0].transpose(0, 1).flatten(1), v[0].transpose(0, 1).flatten(1)]  # (R, H*hd) each
        out["kva"] = torch.cat(cols, dim=1)
    return out


@torch.inference_mode()
def layer_inputs(engine: Engine, ids: torch.Tensor, upto: int | None = None) -> list[torch.Tensor]:
    """Exact forward; returns the input of layers 0..upto (default: every layer and the final state).

    Returns `upto + 1` tensors (1, T, d); `upto` defaults to the number of layers.
    """
    h = engine.embed(ids)
    n = ids.shape[1]
    tables = engine.rope(n, h)
    pos = torch.arange(n, device=h.device)
    states = [h]
    for i in range(engine.parts.num_layers if upto is None else upto):
        h, *_ = engine.layer(i, h, pos, tables)
        states.append(h)
    return states


def _validate(lm: LoadedModel, cfg: FitConfig) -> None:
    bad = [m for m in cfg.methods if m not in MAP_METHODS]
    if bad:
        raise RidgefillError(f"unknown fit method(s) {bad}; choose from {MAP_METHODS}")
    for s in cfg.splits:
        if not 1 <= s <= lm.num_layers - 2:
            raise RidgefillError(f"split {s} is outside 1..{lm.num_layers - 2} for {lm.name} ({lm.num_layers} layers)")
    if cfg.facts < 0:
        raise RidgefillError(f"facts per calibration segment must be >= 0, got {cfg.facts}")
    if cfg.segment_tokens > lm.context_length:
        raise RidgefillError(f"segment_tokens {cfg.segment_tokens} exceeds the context of {lm.context_length}")


@torch.inference_mode()
def fit_maps(
    lm: LoadedModel,
    calib: list[list[int]],
    heldout: list[list[int]],
    cfg: FitConfig,
    corpus: dict | None = None,
) -> tuple[list[FillMaps], dict]:
    """Fit maps for every (split, method) in one pass over the segments.

    Args:
        calib, heldout: token segments (disjoint documents).
        corpus: provenance recorded in each map header (id, documents, tokens).
    Returns:
        (maps, report): one FillMaps per (split, method), and a JSON-ready report with the
        held-out relative error per layer, identity's error for comparison, time and memory.
    """
    _validate(lm, cfg)
    if not calib or not heldout:
        raise RidgefillError("fitting needs at least one calibration and one held-out segment")
    if max(map(len, calib + heldout)) > lm.context_length:
        raise RidgefillError(f"a segment is longer than {lm.name}'s context of {lm.context_length}")
    engine = Engine(lm)
    d = lm.parts.hidden_size
    kv_out = 2 * lm.parts.layers[0].num_kv_heads * lm.parts.layers[0].head_dim
    block = {"ridge": d, "kva": kv_out}
    t0 = time.perf_counter()

    def new_stats(split: int) -> _Stats:
        deep = lm.num_layers - split - 1
        xty = {m: torch.zeros(d + 1, deep * block[m], dtype=torch.float64) for m in cfg.methods}
        return _Stats(torch.zeros(d + 1, d + 1, dtype=torch.float64), xty)

    train = {s: new_stats(s) for s in cfg.splits}
    test = {s: new_stats(s) for s in cfg.splits}
    segments = [(seg, train) for seg in calib] + [(seg, test) for seg in heldout]
    for seg, acc in tqdm(segments, desc=f"fit {lm.name}: segments", unit="seg"):
        states = layer_inputs(engine, torch.tensor([seg]))
        for s in cfg.splits:
            rows = fit_rows(states[s][0], cfg.skip_first, cfg.outlier_factor)
            acc[s].add(states[s][0, rows], _targets(engine, states, s, cfg, rows), block, cfg.normed_targets)

    maps, report = [], {"splits": {}}
    for s in cfg.splits:
        report["splits"][s] = {}
        for m in cfg.methods:
            weights, layers = _solve(train[s], test[s], m, block[m], cfg.alphas, first_layer=s + 1)
            header = {
                "model": fingerprint(lm),
                "model_name": lm.name,
                "fit": {
                    **_header_cfg(cfg),
                    "calib_tokens": sum(map(len, calib)),
                    "heldout_tokens": sum(map(len, heldout)),
                    "calib_rows": train[s].rows,  # tokens left after the sink/outlier rule
                    "heldout_rows": test[s].rows,
                    "lambda_rule": "per layer: alpha * mean(diag(X^T X)), alpha chosen on held-out rows",
                },
                "corpus": corpus or {},
                "layers": layers,
                "package_version": _version(),
            }
            maps.append(FillMaps(m, s, weights, header))
            report["splits"][s][m] = layers
    report.update(
        seconds=round(time.perf_counter() - t0, 1),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        calib_tokens=sum(map(len, calib)),
        heldout_tokens=sum(map(len, heldout)),
    )
    return maps, report


def _header_cfg(cfg: FitConfig) -> dict:
    """The config as map headers hold it: `facts` only when used, so maps fitted as before keep the
    header (and eval cache keys) they always had."""
    out = asdict(cfg)
    if not cfg.facts:
        del out["facts"]
    return out


def _solve(
    train: _Stats, test: _Stats, method: str, out: int, alphas: tuple[float, ...], first_layer: int
) -> tuple[dict[int, torch.Tensor], dict[str, dict]]:
    """Closed-form ridge per alpha; per layer keep the alpha with the lowest held-out error."""
    d = train.xtx.shape[0] - 1
    scale = train.xtx.diagonal()[:d].mean()
    reg = torch.ones(d + 1, dtype=torch.float64)
    reg[d] = 0.0  # the bias is not shrunk
    n_layers = train.xty[method].shape[1] // out
    best_err = torch.full((n_layers,), float("inf"), dtype=torch.float64)
    best_alpha = torch.zeros(n_layers, dtype=torch.float64)
    best_w = torch.zeros_like(train.xty[method])
    yy = test.yy[method]
    for alpha in alphas:
        chol = torch.linalg.cholesky(train.xtx + torch.diag(reg * alpha * scale))
        w = torch.cholesky_solve(train.xty[method], chol)  # (d+1, L*out)
        cross = (w * test.xty[method]).sum(0).view(n_layers, out).sum(1)
        quad = (w * (test.xtx @ w)).sum(0).view(n_layers, out).sum(1)
        err = yy - 2 * cross + quad
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_alpha = torch.where(better, torch.tensor(alpha, dtype=torch.float64), best_alpha)
        cols = better.repeat_interleave(out)
        best_w[:, cols] = w[:, cols]
    layers, weights = {}, {}
    for j in range(n_layers):
        li = first_layer + j
        weights[li] = best_w[:, j * out : (j + 1) * out].float().contiguous()
        entry = {"alpha": float(best_alpha[j]), "heldout_rel_err": float((best_err[j] / yy[j]).clamp(min=0).sqrt())}
        if method == "ridge":  # the identity fill on the same held-out rows
            entry["identity_rel_err"] = float((test.identity_sq[j] / yy[j]).sqrt())
        layers[str(li)] = entry
    return weights, layers


def _version() -> str:
    from ridgefill import __version__

    return __version__


CALIB_TOKENS = 16384  # calibration text of a fit, unless the model's shipped configuration names more


def default_calib_tokens(model_name: str) -> int:
    """Calibration tokens of a fit that names none: what the maps behind the model's shipped tuned
    configuration were fitted on, else `CALIB_TOKENS`."""
    from ridgefill.methods.tuned import shipped_calib_tokens

    return shipped_calib_tokens(model_name) or CALIB_TOKENS


def fit_from_corpus(
    lm: LoadedModel,
    cfg: FitConfig,
    corpus: str | None = None,
    calib_tokens: int | None = None,
    heldout_tokens: int = 4096,
    out_dir: Path | None = None,
) -> tuple[list[Path], dict]:
    """Fit on a corpus's calibration documents (`calib_tokens`, default `default_calib_tokens`),
    choose lambda on its held-out ones, save the maps.

    Returns (map paths, report with the corpus provenance).
    """
    from ridgefill.corpus import load_corpus, token_segments
    from ridgefill.fit.facts import with_facts
    from ridgefill.fit.maps import default_maps_dir, maps_filename, save_maps

    docs = load_corpus(corpus)
    seg = cfg.segment_tokens
    calib_tokens = default_calib_tokens(lm.name) if calib_tokens is None else calib_tokens
    calib, calib_docs = token_segments(lm.tokenizer, docs.part("calib"), seg, calib_tokens)
    calib = with_facts(lm.tokenizer, calib, cfg.facts)
    heldout, heldout_docs = token_segments(lm.tokenizer, docs.part("heldout"), seg, heldout_tokens)
    provenance = {"id": docs.id, "calib_documents": calib_docs, "heldout_documents": heldout_docs}
    maps, report = fit_maps(lm, calib, heldout, cfg, provenance)
    out = Path(out_dir) if out_dir is not None else default_maps_dir(lm)
    paths = [save_maps(m, out / maps_filename(lm.name, m.method, m.split)) for m in maps]
    return paths, {"corpus": provenance, **report}
