"""Variable-length (multi-hot) raw sparse columns: values + lengths, as a KeyedJaggedTensor holds them.

A list column of B rows is `values` int64[N] (all rows' elements, row after row), `lengths` int64[B] and `valid`
bool[N] (False where an element is null). A null list is an empty list. `JaggedColumns` maps column names to
columns and slices rows like a tensor (`cols[a:b]`), so code that slices every field of a RawBatch keeps working.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class JaggedColumn:
    values: Tensor  # int64[N]
    lengths: Tensor  # int64[B]
    valid: Tensor  # bool[N]

    def __post_init__(self) -> None:
        if self.values.dim() != 1 or self.lengths.dim() != 1 or self.valid.shape != self.values.shape:
            raise ValueError(
                f"JaggedColumn: needs values[N], lengths[B], valid[N]; got {list(self.values.shape)}, "
                f"{list(self.lengths.shape)}, {list(self.valid.shape)}"
            )

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    def offsets(self) -> Tensor:
        """int64[B + 1]: row i holds values[offsets[i]:offsets[i + 1]]."""
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def slice_rows(self, start: int, end: int) -> JaggedColumn:
        off = self.offsets()
        start, end = max(0, min(start, self.rows)), max(0, min(end, self.rows))
        end = max(start, end)
        a, b = int(off[start]), int(off[end])
        return JaggedColumn(self.values[a:b], self.lengths[start:end], self.valid[a:b])

    def pad_rows(self, n: int) -> JaggedColumn:
        """n rows: the extra ones empty."""
        pad = n - self.rows
        return JaggedColumn(self.values.clone(), torch.cat([self.lengths, self.lengths.new_zeros(pad)]),
                            self.valid.clone())

    @classmethod
    def concat(cls, parts: list[JaggedColumn]) -> JaggedColumn:
        """The rows of `parts` one after another."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("values", "lengths", "valid")))

    def to(self, device: torch.device | str) -> JaggedColumn:
        return JaggedColumn(self.values.to(device), self.lengths.to(device), self.valid.to(device))

    def to_rows(self) -> list[np.ndarray]:
        """One int64 array per row (nulls as stored), for tests and the reference."""
        off = self.offsets().tolist()
        v = self.values.cpu().numpy()
        return [v[off[i]:off[i + 1]] for i in range(self.rows)]

    @classmethod
    def from_rows(cls, rows: list[list[int | None] | None]) -> JaggedColumn:
        """From Python lists (None = null element; a None row = null list = empty)."""
        lists = [r or [] for r in rows]
        flat = [v for r in lists for v in r]
        return cls(
            values=torch.tensor([0 if v is None else v for v in flat], dtype=torch.int64),
            lengths=torch.tensor([len(r) for r in lists], dtype=torch.int64),
            valid=torch.tensor([v is not None for v in flat], dtype=torch.bool),
        )


class JaggedColumns(Mapping[str, JaggedColumn]):
    """Name -> JaggedColumn, all with the same rows; `[a:b]` slices rows, `["name"]` gets a column."""

    def __init__(self, columns: Mapping[str, JaggedColumn] | None = None):
        self._cols = dict(columns or {})
        rows = {c.rows for c in self._cols.values()}
        if len(rows) > 1:
            raise ValueError(f"JaggedColumns: columns have different row counts {sorted(rows)}")

    def __getitem__(self, key):  # str -> column; slice -> row slice of every column
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise ValueError("JaggedColumns: row slices need step 1")
            rows = self.rows
            start, end, _ = key.indices(rows if rows is not None else 0)
            return JaggedColumns({n: c.slice_rows(start, end) for n, c in self._cols.items()})
        return self._cols[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    def __len__(self) -> int:
        return len(self._cols)

    def __contains__(self, key: object) -> bool:  # Mapping's would go through __getitem__ and a KeyError
        return key in self._cols

    def __repr__(self) -> str:
        return f"JaggedColumns({ {n: c.rows for n, c in self._cols.items()} })"

    @property
    def rows(self) -> int | None:
        return next(iter(self._cols.values())).rows if self._cols else None

    @classmethod
    def concat(cls, parts: list[JaggedColumns]) -> JaggedColumns:
        """The rows of `parts` one after another; every part has the same columns."""
        names = [list(p) for p in parts]
        if any(n != names[0] for n in names):
            raise ValueError(f"JaggedColumns.concat: parts have different columns {names}")
        return cls({n: JaggedColumn.concat([p[n] for p in parts]) for n in names[0]})

    def to(self, device: torch.device | str) -> JaggedColumns:
        return JaggedColumns({n: c.to(device) for n, c in self._cols.items()})

    def pad_rows(self, n: int) -> JaggedColumns:
        return JaggedColumns({k: c.pad_rows(n) for k, c in self._cols.items()})
