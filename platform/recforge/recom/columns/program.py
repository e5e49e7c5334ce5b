"""The column IR: what one embedding column computes, independent of how the graph spelled it.

A ``ColumnProgram`` reads one raw input (a column of a [B] / [B, F] tensor, or a jagged values tensor
with its lengths), applies ``steps`` element by element (translation and filters), then looks the ids up:
``gather`` (one id per row) or ``pool`` (sum / mean over each row's ids; an empty row gives zeros or the
row of a default id). The analysis (``analyze.py``) writes what the graph does, redundancy included;
the passes (``passes.py``) simplify it; the planner (``plan.py``) lowers it to the fused kernel's metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from recforge.recom.columns.intervals import IntervalSet


@dataclass(frozen=True)
class Src:
    """Raw values: flat user input ``input`` (placeholder name), column ``col`` of it when it is 2-D."""

    input: str
    col: int | None = None
    dtype: str = "int64"

    def __str__(self) -> str:
        return self.input if self.col is None else f"{self.input}[:, {self.col}]"


# steps -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Select:
    """x if (flag in ``keep``) else ``value``: the flag is another input (a null mask), read per element."""

    flag: Src
    keep: IntervalSet
    value: int


@dataclass(frozen=True)
class Bucketize:
    boundaries: tuple[float, ...]
    right: bool = False

    @property
    def range(self) -> IntervalSet:
        return IntervalSet.of((0, len(self.boundaries)))  # [0, K], both ends included (TF's too)


@dataclass(frozen=True)
class Mod:
    n: int  # floor-mod, n > 0: [0, n)


@dataclass(frozen=True)
class SigridHash:
    salt: int
    m: int  # [0, m)


@dataclass(frozen=True)
class Clamp:
    lo: int | None
    hi: int | None


@dataclass(frozen=True)
class AddConst:
    c: int


@dataclass(frozen=True)
class Replace:
    """A "Replace" filter: x if x in ``keep`` else ``value`` (torch.where / masked_fill on x itself)."""

    keep: IntervalSet
    value: int


@dataclass(frozen=True)
class Remove:
    """A "Remove" filter: the element is dropped unless x in ``keep`` (boolean indexing, padding_idx)."""

    keep: IntervalSet


Step = Select | Bucketize | Mod | SigridHash | Clamp | AddConst | Replace | Remove
FILTERS = (Clamp, Replace, Remove)


_STEP_FORMATS = {
    Bucketize: lambda s: f"bucketize(K={len(s.boundaries)}{', right' if s.right else ''})",
    Mod: lambda s: f"mod({s.n})",
    SigridHash: lambda s: f"sigrid_hash(salt={s.salt}, M={s.m})",
    Clamp: lambda s: f"clamp({s.lo}, {s.hi})",
    AddConst: lambda s: f"add({s.c})",
    Replace: lambda s: f"replace(keep {s.keep}, else {s.value})",
    Remove: lambda s: f"remove(keep {s.keep})",
    Select: lambda s: f"select({s.flag} in {s.keep} ? x : {s.value})",
}


def step_str(s: Step) -> str:
    fmt = _STEP_FORMATS.get(type(s))
    return fmt(s) if fmt is not None else repr(s)


# the column ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColumnProgram:
    name: str  # the table's state-dict key
    table: str  # the table's placeholder
    rows: int
    dim: int
    value: Src
    steps: tuple[Step, ...]
    lookup: str  # "gather" | "pool"
    mode: str = "sum"  # pool: "sum" | "mean"
    lengths: str | None = None  # jagged: the lengths input ([B]); None: one element per row
    one_id_proof: str | None = None  # pool over rows proven to hold one id each
    fill_empty: int | None = None  # empty rows get this id before pooling (sparse_fill_empty_rows)
    zero_empty: bool = False  # rows empty before the fill are zeroed after pooling
    unique: bool = False  # ids go through unique + inverse before the gather
    notes: tuple[str, ...] = field(default=())

    def with_(self, **changes) -> ColumnProgram:
        return replace(self, **changes)

    @property
    def jagged(self) -> bool:
        return self.lengths is not None

    def describe(self) -> str:
        parts = [str(self.value), *map(step_str, self.steps)]
        if self.unique:
            parts.append("unique")
        if self.fill_empty is not None:
            parts.append(f"fill_empty({self.fill_empty})")
        tail = f"gather {self.table}" if self.lookup == "gather" else f"pool_{self.mode} {self.table}"
        if self.jagged:
            tail += f" by {self.lengths}"
        if self.zero_empty:
            tail += " -> zero empty rows"
        return " -> ".join(parts + [tail])
