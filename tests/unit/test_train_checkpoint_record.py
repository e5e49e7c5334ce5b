"""The train stage's checkpoint record, built from the work dir's files (events, launches, task attempts, ledger),
and the metrics sink of a resumed group (no step logged twice)."""
from __future__ import annotations

import json
from pathlib import Path

from recforge.pipelines.stages.train import checkpoint_record
from recforge.train.loop.ledger import Ledger
from recforge.worker.trainer import AfterStep


def _lines(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


def test_record_over_a_killed_task_attempt_and_a_failed_group(tmp_path):
    # task attempt 1 (t=100): generation 0 checkpoints at 20 and 40, then the task process is killed at step ~50.
    # task attempt 2 (t=200): generation 1 resumes from step 40, its worker dies after step 60 and is relaunched:
    # generation 2 resumes from 60 and finishes at step 90.
    _lines(tmp_path / "tasks.jsonl", [{"pid": 1, "time": 100.0}, {"pid": 2, "time": 200.0}])
    _lines(tmp_path / "events.jsonl", [
        {"event": "start", "generation": 0, "time": 101.0, "resumed_from_step": None, "step": 0},
        {"event": "checkpoint", "generation": 0, "time": 110.0, "step": 20, "stall_s": 0.5, "train_s": 10.0},
        {"event": "checkpoint", "generation": 0, "time": 120.0, "step": 40, "stall_s": 0.1, "train_s": 20.0},
        {"event": "start", "generation": 1, "time": 201.0, "resumed_from_step": 40, "step": 40},
        {"event": "checkpoint", "generation": 1, "time": 215.0, "step": 60, "stall_s": 0.4, "train_s": 10.0},
        {"event": "start", "generation": 2, "time": 230.0, "resumed_from_step": 60, "step": 60},
        {"event": "finish", "generation": 2, "time": 250.0, "step": 90, "train_s": 20.0},
    ])
    _lines(tmp_path / "attempts.jsonl", [{"outcome": "failed", "relaunched": True},
                                         {"outcome": "finished", "relaunched": False}])
    ledger = tmp_path / "ledger"
    g0 = Ledger(ledger, 0, 0)
    g0.start(None, None, 1)
    g0.record(0, 0, 0, 10)
    g0.mark_checkpoint(40)
    g0.record(0, 0, 10, 14)  # trained after the checkpoint step 40: lost with the killed task
    g0.close()
    g1 = Ledger(ledger, 1, 0, since=40)
    g1.start(40, 0, 1)
    g1.record(0, 0, 10, 20)
    g1.close()
    rec = checkpoint_record(tmp_path, 20, True, task_started=200.0)
    assert rec.taken == 3 and abs(rec.overhead_s - 1.0) < 1e-9
    assert abs(rec.overhead_fraction - 1.0 / (20.0 + 10.0 + 20.0)) < 1e-9
    assert rec.resumed_from_step == 40  # this task attempt's first group
    assert rec.resumes == 1 and rec.restarts == 1
    assert rec.rows_retrained == 4  # rows 10..13 of generation 0 were trained again by generation 1


def test_first_attempt_without_failures(tmp_path):
    _lines(tmp_path / "tasks.jsonl", [{"pid": 1, "time": 100.0}])
    _lines(tmp_path / "events.jsonl", [
        {"event": "start", "generation": 0, "time": 101.0, "resumed_from_step": None, "step": 0},
        {"event": "finish", "generation": 0, "time": 150.0, "step": 30, "train_s": 40.0},
    ])
    rec = checkpoint_record(tmp_path, 50, False, task_started=100.0)
    assert (rec.taken, rec.overhead_s, rec.overhead_fraction) == (0, 0.0, 0.0)
    assert (rec.resumed_from_step, rec.resumes, rec.restarts, rec.rows_retrained) == (None, 0, 0, 0)


class _Sink:
    def __init__(self):
        self.logged, self.closed = [], False

    def __call__(self, metrics, step):
        self.logged.append(step)

    def close(self):
        self.closed = True


def test_a_resumed_group_logs_only_steps_after_those_already_logged():
    inner = _Sink()
    sink = AfterStep(inner, after=60)  # a dead group logged up to step 60; this one resumed from 40
    for step in (40, 60, 80, 100):
        sink({"train_loss": 0.5}, step)
    sink.close()
    assert inner.logged == [80, 100] and inner.closed
    fresh = _Sink()
    AfterStep(fresh, after=None)({"train_loss": 0.5}, 20)
    assert fresh.logged == [20]
