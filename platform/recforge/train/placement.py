"""Where one embedding table lives across the ranks: the input shard_model takes instead of TorchRec's planner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["table_wise", "column_wise", "data_parallel"]


@dataclass(frozen=True)
class Placement:
    """A table's sharding kind and the ranks holding it (table_wise: one rank; column_wise: its shards' ranks;
    data_parallel: every rank)."""

    kind: Kind
    ranks: tuple[int, ...]

    def label(self) -> str:
        return f"{self.kind}{list(self.ranks)}"
