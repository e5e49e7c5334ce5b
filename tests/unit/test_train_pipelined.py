"""The pipelined step loop (recforge.train.loop.pipelined: TorchRec's TrainPipelineSparseDist inside train_epoch) with
a real sharded DLRM, real shards and PrefetchBatches (one gloo rank in this process):

1. it trains what the plain loop trains: the same model after an epoch (the pipeline only moves the input dist);
2. a checkpoint at a window boundary, with steps in flight, leaves those steps' rows to be read again: a run stopped
   there and resumed from the job master's snapshot (TaskQueue.snapshot / from_dict, as recforge.train.recovery does)
   trains every row exactly once, and no task in flight is reported done;
3. the sharded EBC gets its own forward back after the epoch (also after a stop), the switch refuses bad values and
   a loop it does not apply to.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from gloo_world import world1  # noqa: F401 (fixture)
from recforge.config import ModelConfig, TrainConfig
from recforge.elastic.master.tasks import TaskQueue
from recforge.preprocess.executor import TorchExecutor
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.loop.batches import TaskBatches, empty
from recforge.train.loop.pipelined import PIPELINE_ENV, pipeline_override
from recforge.train.loop.prefetch import PrefetchBatches
from recforge.train.loop.step_loop import LoopState, PhaseTimes, train_epoch
from recforge.train.model import EBC_PATH, build_dlrm
from recforge.train.sharding import shard_model
from task_source_fixtures import DS, FakeClient, task, tiny_shards

pytestmark = pytest.mark.usefixtures("world1")  # one gloo rank (gloo_world)
CPU = torch.device("cpu")
BATCH = 16
SHARD_ROWS = [130, 100]  # tiny_shards
PLAN = criteo_plan(DS, table_cap=16)


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    return tiny_shards(tmp_path_factory.mktemp("pipelined"))


class Rows:
    """A ledger (TaskBatches' `ledger`): every trained batch's rows, in order."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []

    def record(self, epoch: int, shard: int, a: int, b: int) -> None:
        self.rows.extend((epoch, shard, r) for r in range(a, b))


class QueueClient:
    """The job master's task queue in process, as one worker's client."""

    def __init__(self, queue: TaskQueue) -> None:
        self.queue, self.events = queue, []

    def lease(self):
        t = self.queue.lease("w0", time.monotonic())
        self.events.append(("lease", t.task_id if t else None))
        return t

    def done(self, task_id, samples):
        self.events.append(("done", task_id, samples))
        return self.queue.done(task_id, "w0").ok


def _model(fused=True):
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), PLAN.tables(),
                       len(PLAN.dense_features()))
    train = TrainConfig(batch_size=BATCH, fused_embeddings=fused, sharding="table_wise" if fused else "data_parallel",
                        embedding_lr=0.2, dense_lr=0.05)
    return shard_model(model, train, world_size=1, device=CPU)


def _source(manifest_dir, client, ledger=None):
    ex = TorchExecutor(PLAN, DS)
    inner = TaskBatches(client, manifest_dir, DS, ex, batch_size=BATCH, device=CPU, ledger=ledger)
    return PrefetchBatches(inner, depth=2), empty(DS, BATCH, ex, CPU)


def _predict(sm, manifest_dir):
    src, _ = _source(manifest_dir, FakeClient([task(0, 0, 0, 64)]))
    b = src.next()
    src.close()
    with torch.no_grad():
        return sm.model(b.dense, b.sparse).reshape(-1)


def _ebc_forward_is_its_own(sm) -> bool:
    ebc = sm.model.module.get_submodule(EBC_PATH)
    dists = [d._dist for m in ebc.modules() for d in getattr(m, "_input_dists", None) or [] if hasattr(d, "_dist")]
    return "forward" not in vars(ebc) and not any("forward" in vars(d) for d in dists)


@pytest.mark.parametrize("fused", [True, False])
def test_pipelined_epoch_trains_what_the_plain_loop_trains(manifest_dir, fused):
    tasks = [task(0, 0, 0, 50), task(1, 1, 0, 100), task(2, 0, 50, 130)]
    models = {}
    for pipelined in (False, True):
        sm, state = _model(fused), LoopState()
        for epoch in range(2):  # a new pipeline per epoch: the model is traced again after the last one's detach
            ledger = Rows()
            src, zero = _source(manifest_dir, FakeClient(list(tasks)), ledger)
            phases = PhaseTimes()
            stats = train_epoch(sm, src, zero, state, epoch=epoch, world_size=1, log_every=3, pipelined=pipelined,
                                phases=phases)
            assert stats.samples == 230 and stats.steps == 16  # 4 + 7 + 5 batches of <= 16 rows
            assert sorted(ledger.rows) == sorted((0, s, r) for s, n in enumerate(SHARD_ROWS) for r in range(n))
            assert _ebc_forward_is_its_own(sm)
            assert (phases.seconds["input_dist"] > 0) == pipelined
        assert state.step == 32
        models[pipelined] = _predict(sm, manifest_dir)
    untrained = _predict(_model(fused), manifest_dir)
    assert (models[False] - untrained).abs().max() > 1e-2
    torch.testing.assert_close(models[True], models[False], rtol=1e-5, atol=1e-6)


class Stop(Exception):
    pass


def test_stop_at_a_window_with_steps_in_flight_then_resume_trains_every_row_once(manifest_dir):
    queue = TaskQueue(SHARD_ROWS, rows_per_task=40)  # tasks of 40 rows: batches 16, 16, 8
    client, ledger, sm = QueueClient(queue), Rows(), _model()
    src, zero = _source(manifest_dir, client, ledger)
    saved = {}

    def hook(state, stats):
        if state.step == 4:  # the second task's first batch trained; 2 more steps in flight
            progress = src.progress()  # flushes the done reports first
            saved.update(snapshot=queue.snapshot(progress), progress=progress, rows=list(ledger.rows),
                         handed=src._taken, done=[e[1] for e in client.events if e[0] == "done"],
                         state={k: v.clone() for k, v in sm.model.state_dict().items()})
            raise Stop

    with pytest.raises(Stop):
        train_epoch(sm, src, zero, LoopState(), epoch=0, world_size=1, log_every=2, on_window=hook, pipelined=True)
    src.close()
    assert _ebc_forward_is_its_own(sm)  # detached on the way out
    # 4 steps trained, 6 handed out to the pipeline (the next one's input dist done, the one after read)
    assert len(saved["rows"]) == 16 + 16 + 8 + 16 and saved["handed"] == 6
    (held,) = saved["progress"].items()
    assert held[1] == 16  # the held task counts its trained batch only, not the two in flight
    assert held[0] not in saved["done"] and len(saved["done"]) == 1  # only the fully trained first task is done

    # resume: the master restored from the checkpoint's snapshot hands out exactly the rows not in the model
    queue2 = TaskQueue.from_dict(saved["snapshot"])
    client2, ledger2 = QueueClient(queue2), Rows()
    sm2 = _model()
    sm2.model.load_state_dict(saved["state"])
    src2, zero2 = _source(manifest_dir, client2, ledger2)
    stats = train_epoch(sm2, src2, zero2, LoopState(step=4), epoch=0, world_size=1, log_every=2, pipelined=True)
    rows = Counter(saved["rows"] + ledger2.rows)
    assert set(rows) == {(0, s, r) for s, n in enumerate(SHARD_ROWS) for r in range(n)}
    assert max(rows.values()) == 1  # every row exactly once
    assert stats.samples == sum(SHARD_ROWS) - len(saved["rows"])
    assert queue2.finished or queue2.epoch >= 1


def test_switch_and_refusals(manifest_dir):
    assert pipeline_override({PIPELINE_ENV: "1"}) is True
    assert pipeline_override({}) is None and pipeline_override({PIPELINE_ENV: "0"}) is False
    with pytest.raises(ValueError, match=PIPELINE_ENV):
        pipeline_override({PIPELINE_ENV: "fast"})
    sm = _model()
    ex = TorchExecutor(PLAN, DS)
    plain = TaskBatches(FakeClient([task(0, 0, 0, 20)]), manifest_dir, DS, ex, batch_size=BATCH, device=CPU)
    with pytest.raises(ValueError, match="PrefetchBatches source"):
        train_epoch(sm, plain, empty(DS, BATCH, ex, CPU), LoopState(), epoch=0, world_size=1, log_every=5,
                    pipelined=True)
    src, zero = _source(manifest_dir, FakeClient([task(0, 0, 0, 20)]))
    src.next_step()
    with pytest.raises(RuntimeError, match="already handed out"):
        src.defer_progress()
    src.close()
