"""Per-sample accounting: which rows each rank trained, and which of them the final model contains.

Every rank appends one JSON line per trained batch to `gen<g>-rank<r>.jsonl`:
{"e": epoch, "s": shard, "a": row_start, "b": row_end, "since": step of the last checkpoint before it}.
Rank 0 writes `gen<g>.json` when a group starts: the checkpoint it resumed from (step and the
generation that saved it), or none.

The final model's lineage: the last generation's rows, plus the rows of the generation that saved
the checkpoint it resumed from (step c) trained before c (`since < c`), and so on back to a start
without checkpoint. `audit` counts both the lineage and all rows ever trained; the guarantee of
recforge.train.recovery.resume is: the lineage holds every row of every epoch exactly once, and a row was
trained more than once only if a failed group trained it after the checkpoint that was resumed.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

Row = tuple[int, int, int]  # (epoch, shard, row)


class Ledger:
    """One rank's append-only record (unbuffered writes: a SIGKILL loses nothing already recorded)."""

    def __init__(self, root: str | Path, generation: int, rank: int, since: int = 0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.generation, self.rank, self.since = generation, rank, since
        self._fd = os.open(self.root / f"gen{generation:04d}-rank{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def start(self, resumed_step: int | None, saved_by: int | None, world_size: int) -> None:
        """Rank 0, once per group: where this generation's model came from."""
        doc = {"generation": self.generation, "resumed_step": resumed_step, "saved_by": saved_by,
               "world_size": world_size}
        tmp = self.root / f".gen{self.generation:04d}.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.root / f"gen{self.generation:04d}.json")

    def record(self, epoch: int, shard: int, row_start: int, row_end: int) -> None:
        line = json.dumps({"e": epoch, "s": shard, "a": row_start, "b": row_end, "since": self.since}) + "\n"
        os.write(self._fd, line.encode())

    def mark_checkpoint(self, step: int) -> None:
        self.since = step

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class Audit:
    lineage: Counter = field(default_factory=Counter)  # rows in the final model's lineage
    trained: Counter = field(default_factory=Counter)  # every row ever trained
    chain: list[int] = field(default_factory=list)  # generations of the lineage, last first
    generations: dict[int, dict[str, Any]] = field(default_factory=dict)

    def rows(self, counter: Counter, value: int | None = None) -> set[Row]:
        return {r for r, n in counter.items() if value is None or n == value}

    @property
    def redone(self) -> Counter:
        """Rows trained more often than the lineage holds them (work lost at failures)."""
        return self.trained - self.lineage


def _entries(root: Path, generation: int) -> list[dict[str, int]]:
    out = []
    for p in sorted(root.glob(f"gen{generation:04d}-rank*.jsonl")):
        for line in p.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line torn by a kill mid-write was never completed: not trained-and-kept
                    continue
    return out


def _expand(entry: dict[str, int]) -> list[Row]:
    return [(entry["e"], entry["s"], r) for r in range(entry["a"], entry["b"])]


def _generations(root: Path) -> dict[int, dict[str, Any]]:
    gens = {}
    for p in root.glob("gen*.json"):
        m = re.fullmatch(r"gen(\d{4})\.json", p.name)
        if m:
            gens[int(m.group(1))] = json.loads(p.read_text())
    if not gens:
        raise FileNotFoundError(f"no ledger generations in {root}")
    return gens


def _lineage(root: Path, gens: dict[int, dict[str, Any]], final_generation: int | None,
             ) -> tuple[list[int], list[dict[str, int]]]:
    """The lineage's generations (last first) and its entries: the final model's rows, as recorded."""
    g = max(gens) if final_generation is None else final_generation
    chain: list[int] = []
    entries: list[dict[str, int]] = []
    limit: int | None = None  # rows of generation g trained before this step belong to the lineage
    while True:
        if g not in gens:
            raise ValueError(f"ledger: generation {g} is referenced but has no gen{g:04d}.json in {root}")
        chain.append(g)
        entries.extend(e for e in _entries(root, g) if limit is None or e["since"] < limit)
        head = gens[g]
        if head["resumed_step"] is None:
            return chain, entries
        limit, g = int(head["resumed_step"]), int(head["saved_by"])


def audit(root: str | Path, final_generation: int | None = None) -> Audit:
    """Every row trained and the final model's lineage, row by row (memory grows with the rows: tests and
    benchmarks; `rows_retrained` counts the redone rows in memory proportional to the ledger's entries)."""
    root = Path(root)
    gens = _generations(root)
    out = Audit(generations=gens)
    for g in gens:
        for e in _entries(root, g):
            out.trained.update(_expand(e))
    out.chain, lineage = _lineage(root, gens, final_generation)
    for e in lineage:
        out.lineage.update(_expand(e))
    return out


def _boundary_deltas(entries: Iterable[dict[str, int]]) -> dict[tuple[int, int], Counter]:
    """(epoch, shard) -> row -> the change, at that row, of how many entries cover it."""
    out: dict[tuple[int, int], Counter] = {}
    for e in entries:
        c = out.setdefault((e["e"], e["s"]), Counter())
        c[e["a"]] += 1
        c[e["b"]] -= 1
    return out


def rows_retrained(root: str | Path, final_generation: int | None = None) -> int:
    """sum(audit(root).redone.values()) without expanding rows: per (epoch, shard), a sweep over the entries'
    boundaries adds up max(0, times trained - times in the lineage) over each run of rows."""
    root = Path(root)
    gens = _generations(root)
    trained_deltas = _boundary_deltas(e for g in gens for e in _entries(root, g))
    lineage_deltas = _boundary_deltas(_lineage(root, gens, final_generation)[1])
    total = 0
    for key in trained_deltas.keys() | lineage_deltas.keys():
        t, lin = trained_deltas.get(key, Counter()), lineage_deltas.get(key, Counter())
        bounds = sorted(t.keys() | lin.keys())
        n_trained = n_lineage = 0
        for here, nxt in pairwise(bounds):
            n_trained += t[here]
            n_lineage += lin[here]
            total += max(0, n_trained - n_lineage) * (nxt - here)
    return total
