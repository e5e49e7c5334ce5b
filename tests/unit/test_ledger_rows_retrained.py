"""rows_retrained (interval sweep, memory per ledger entry) equals the row-by-row audit's redone count."""
from __future__ import annotations

import random

import pytest

from recforge.train.loop.ledger import Ledger, audit, rows_retrained


def _random_ledger(root, seed: int) -> None:
    """Up to four generations, each resuming from a random earlier one at a random step, training overlapping,
    unaligned row ranges of a few shards in two epochs across two ranks."""
    rng = random.Random(seed)
    generations = rng.randint(1, 4)
    for g in range(generations):
        resumed = rng.choice([None, *range(g)]) if g else None
        writers = [Ledger(root, g, r, since=0) for r in range(2)]
        writers[0].start(rng.randint(0, 6) if resumed is not None else None, resumed, world_size=2)
        for step in range(rng.randint(1, 8)):
            for w in writers:
                if rng.random() < 0.3:
                    w.mark_checkpoint(step)
                a = rng.randint(0, 60)
                w.record(rng.randint(0, 1), rng.randint(0, 2), a, a + rng.randint(0, 25))
        for w in writers:
            w.close()


@pytest.mark.parametrize("seed", range(12))
def test_rows_retrained_equals_the_audit(tmp_path, seed):
    _random_ledger(tmp_path, seed)
    expected = sum(audit(tmp_path).redone.values())
    assert rows_retrained(tmp_path) == expected


def test_rows_retrained_of_a_resume_counts_the_rows_after_the_checkpoint(tmp_path):
    g0 = Ledger(tmp_path, 0, 0)
    g0.start(None, None, world_size=1)
    g0.record(0, 0, 0, 20)
    g0.mark_checkpoint(2)
    g0.record(0, 0, 20, 40)  # after the checkpoint: lost when generation 0 dies
    g0.close()
    g1 = Ledger(tmp_path, 1, 0, since=2)
    g1.start(2, 0, world_size=1)
    g1.record(0, 0, 20, 50)
    g1.close()
    assert rows_retrained(tmp_path) == 20
    with pytest.raises(FileNotFoundError):
        rows_retrained(tmp_path / "none")
