"""The tuner's search space: ridge fill configurations over split, tail and the retrieval knobs,
and the token gates it may choose instead.

What it is: `Candidate` (a method and its settings, with a stable label) and `grid`, which crosses
splits, tails, query-aware full rows and drop fractions (ridge; with a drop, the three-tier
gated-ridge) and adds the given `tokengate` configurations. What it is not: the search loop
(tune/search.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ridgefill.errors import RidgefillError
from ridgefill.methods.fill import FillSettings
from ridgefill.methods.gate import GateSettings
from ridgefill.methods.registry import maps_read


@dataclass(frozen=True)
class Candidate:
    """One configuration the tuner measures."""

    method: str  # "ridge" or "identity" with FillSettings, or "tokengate" with GateSettings
    settings: FillSettings | GateSettings

    @property
    def lower(self) -> int:
        """The layer where it departs from exact: the split, or the gate layer."""
        return getattr(self.settings, self.settings.MAPS_AT)

    @property
    def maps_split(self) -> int | None:
        """The split of the ridge maps it reads (None: it reads none)."""
        return maps_split(self.method, vars(self.settings))

    @property
    def label(self) -> str:
        s = self.settings
        if isinstance(s, GateSettings):
            changed = [f"{f.name}={getattr(s, f.name):g}" for f in fields(s) if _gate_label_field(s, f)]
            return ":".join([f"{self.method}@{s.gate_layer}", f"keep={s.keep:g}", *changed])
        parts = [f"{self.method}@{s.split}", f"tail={s.tail}"]
        if s.query_rows:
            parts.append(f"query_rows={s.query_rows}")
        if s.query_rows and s.query_sentence:
            parts.append(f"query_sentence={s.query_sentence}")
        if (s.query_rows or s.drop) and s.query_pool > 1:
            parts.append(f"query_pool={s.query_pool}")
        if (s.query_rows or s.drop) and s.query_layer is not None:
            parts.append(f"query_layer={s.query_layer}")
        if (s.query_rows or s.drop) and s.query_top:
            parts.append(f"query_top={s.query_top}")
        if s.drop and s.drop_top is not None:
            parts.append(f"drop_top={s.drop_top}")
        if s.drop:
            parts.append(f"drop={s.drop:g}")
        if s.sparse_keep < 1:
            parts.append(f"sparse_keep={s.sparse_keep:g}")
        return ":".join(parts)


def _gate_label_field(s: GateSettings, f) -> bool:
    return f.name not in ("gate_layer", "keep") and getattr(s, f.name) not in (f.default, None)


def maps_split(method: str, settings: dict) -> int | None:
    """The split of the fitted maps a method reads with these settings (None: none)."""
    read = maps_read(method, settings)
    return None if read is None else read[1]


@dataclass(frozen=True)
class Space:
    """The values the grid crosses. Empty `splits`: a third, two fifths and half of the layers."""

    splits: tuple[int, ...] = ()
    tails: tuple[int, ...] = (256, 512)
    query_rows: tuple[int, ...] = (512,)
    drops: tuple[float, ...] = (0.5, 0.75)
    sparse_keeps: tuple[float, ...] = (1.0, 0.5)
    sink: int = 4
    query_sentence: int = 0  # query spans also cover their peak's sentence, this far either side (0: off)
    query_pool: int = 1  # query scores averaged over this many neighbouring tokens (1: none)
    query_above: int = 0  # query scores at the layer this far above the split, on the maps' prediction (0: the split)
    query_top: int = 0  # per head, the mean of this many largest query weights (0: of every query)
    drop_top: int | None = None  # the same for the drop's blocks alone (None: query_top)
    gates: tuple[GateSettings, ...] = ()  # token gates measured beside the fills

    def resolved_splits(self, num_layers: int) -> tuple[int, ...]:
        if self.splits:
            return tuple(sorted(set(self.splits)))
        return tuple(sorted({max(1, round(num_layers * f)) for f in (1 / 3, 2 / 5, 1 / 2)}))


def grid(space: Space, num_layers: int) -> list[Candidate]:
    """Every split with plain ridge (the reference), then split x tail x query rows x drop x
    sparse_keep (block-sparse attention in the layers below the split), then each token gate.

    A drop without query rows is left out: it removes rows by the same score that picks the query
    rows, so without them it only loses information (measured on SmolLM2, docs/results.md).
    """
    splits = space.resolved_splits(num_layers)
    bad = [s for s in splits if not 0 < s < num_layers - 1]
    if bad:
        raise RidgefillError(f"split(s) {bad} leave nothing to fill in a {num_layers}-layer model")
    if not space.tails or min(space.tails) < 1:
        raise RidgefillError("tails must be positive token counts")
    out = []
    for split in splits:
        base = FillSettings(split=split, sink=space.sink, tail=min(space.tails))
        out.append(Candidate("ridge", base))
        for tail in space.tails:
            for q in space.query_rows:
                for drop in (0.0, *space.drops):
                    for keep in space.sparse_keeps or (1.0,):
                        s = FillSettings(
                            split,
                            space.sink,
                            tail,
                            query_rows=q,
                            query_sentence=space.query_sentence if q else 0,
                            query_pool=space.query_pool if q or drop else 1,
                            query_layer=split + space.query_above if space.query_above and (q or drop) else None,
                            query_top=space.query_top if q or drop else 0,
                            drop_top=space.drop_top if drop else None,
                            drop=drop,
                            sparse_keep=keep,
                        )
                        s.check(num_layers)
                        out.append(Candidate("ridge", s))
    for g in space.gates:
        g.check(num_layers)
        out.append(Candidate("tokengate", g.at(num_layers)))
    return list({c.label: c for c in out}.values())
