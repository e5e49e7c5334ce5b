"""Abstract values of the column analysis: what a node of a column holds, in terms of the raw inputs.

A ``Stream`` is per-element values (a source input, the steps applied so far, the index space it runs
over); a ``Cond`` a condition on such values; a ``Grid`` several features side by side; ``Seg`` /
``Counts`` / ``EmptyMask`` the segment structure of a jagged input; ``Rows`` / ``Lookup`` gathered and
pooled table rows. Index spaces: ``Elems`` (an input's elements), ``Filt`` (those a condition keeps),
``Filled`` (plus one element per empty row).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from recforge.recom.columns.intervals import IntervalSet
from recforge.recom.columns.program import Src


class Unsupported(Exception):
    """An op or argument the column analysis does not model; the message says which."""


@dataclass(frozen=True)
class Elems:  # index space: the elements of an input's dim 0
    input: str


@dataclass(frozen=True)
class Filt:  # the elements of ``parent`` where ``cond`` holds
    parent: Any
    cond: Cond


@dataclass(frozen=True)
class _Extends:
    """An index space derived from ``parent`` over the rows of the jagged input with ``lengths``."""

    parent: Any
    lengths: str


@dataclass(frozen=True)
class Filled(_Extends):  # ``parent`` plus one element for each row with none (sparse_fill_empty_rows)
    pass


@dataclass(frozen=True)
class EmptyRowsDom(_Extends):  # one element for each row of ``parent`` with none
    pass


@dataclass(frozen=True)
class Stream:
    dom: Any
    src: Src
    steps: tuple
    is_float: bool
    fill: int | None = None  # value of the elements a Filled dom added


@dataclass(frozen=True)
class Cond:
    dom: Any
    src: Src
    steps: tuple
    keep: IntervalSet


@dataclass(frozen=True)
class Grid:
    """Features side by side: element (b, j) holds cols[j] at row b. The tensor has the batch on axis 0,
    the F features on axis ``faxis`` and size 1 on every other axis; ``faxis`` None: flattened to
    [B*F] (or [B*F, 1, ...]), row-major. Any of these layouts keeps the (b, j) order."""

    cols: tuple
    faxis: int | None = 1

    @property
    def flat(self) -> bool:
        return self.faxis is None


@dataclass(frozen=True)
class Const:
    tensor: torch.Tensor

    def __hash__(self):
        return id(self.tensor)

    def __eq__(self, other):
        return isinstance(other, Const) and other.tensor is self.tensor


@dataclass(frozen=True)
class Table:
    name: str


@dataclass(frozen=True)
class Sym:
    expr: Any


@dataclass(frozen=True)
class Like:  # zeros_like / full_like / ones_like of something: a constant of that layout
    value: float | int
    of: Any


@dataclass(frozen=True)
class Ones:  # a constant tensor of ones (torch.ones(n)) with n elements
    n: Any


@dataclass(frozen=True)
class Zeros:
    shape: tuple
    is_float: bool


@dataclass(frozen=True)
class RowIndex:  # arange(B)
    pass


@dataclass(frozen=True)
class Cumsum:
    lengths: str


@dataclass(frozen=True)
class Offsets:
    lengths: str
    include_last: bool


@dataclass(frozen=True)
class _PerRow:
    """A value about the rows of the jagged input with ``lengths``, over index space ``dom``."""

    dom: Any
    lengths: str


@dataclass(frozen=True)
class Seg(_PerRow):  # the row of each element
    pass


@dataclass(frozen=True)
class Counts(_PerRow):  # elements per row
    clamped: bool = False  # clamp(min=1) applied


@dataclass(frozen=True)
class EmptyMask(_PerRow):  # rows with no element
    pass


@dataclass(frozen=True)
class EmptyRows(_PerRow):  # arange(B)[empty]: the row ids of the empty rows
    pass


@dataclass(frozen=True)
class UniqueOf:
    stream: Stream
    part: str  # "values" | "inverse" | "counts"


@dataclass(frozen=True)
class UniqueRows:
    table: str
    stream: Stream


@dataclass(frozen=True)
class Rows:
    table: str
    stream: Stream
    via_unique: bool = False


@dataclass(frozen=True)
class Bag:  # the tuple an embedding_bag returns; element 0 is the lookup
    lookup: Lookup


@dataclass(frozen=True)
class Lookup:
    table: str
    stream: Stream
    kind: str  # "gather" | "pool"
    mode: str = "sum"
    lengths: str | None = None
    one_id_proof: str | None = None
    unique: bool = False
    zero_empty: bool = False
    extra_steps: tuple = ()  # Remove steps the lookup itself applies (padding_idx)


@dataclass(frozen=True)
class Dead:  # a value nothing may read (an unused output of a multi-output op)
    why: str


INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
