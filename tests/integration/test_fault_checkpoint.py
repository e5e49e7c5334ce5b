"""Step checkpoints against plain references, with real TorchRec models.

1. A checkpoint saved by 2 ranks (model + optimizer state, DCP) loads into 1 rank, resharded, and the
   next step there equals the next step the 2 ranks take without any checkpoint.
2. A corrupt newest checkpoint is skipped with a warning naming the file; the previous one loads.
3. Gradient accumulation (k micro-batches, one optimizer step) equals one step on the whole batch.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from recforge.elastic.backends.local import free_port

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_distributed import NUM_DENSE, TABLES, _data, _kjt, _model_cfg  # noqa: E402

STEP_ROWS = 8  # global rows per step


def _build(world, fused=True, sharding="auto"):
    from recforge.config import TrainConfig
    from recforge.train.model import build_dlrm
    from recforge.train.sharding import shard_model

    torch.manual_seed(0)
    model = build_dlrm(_model_cfg(), TABLES, NUM_DENSE)
    train = TrainConfig(sharding=sharding, fused_embeddings=fused, embedding_lr=0.2, dense_lr=0.1, batch_size=STEP_ROWS)
    return shard_model(model, train, world_size=world, device=torch.device("cpu"))


def _step(sm, rank, world, step):
    """One exact global step over rows [8*step, 8*step + 8), split evenly over the ranks."""
    from recforge.train.loop.loss import step_loss

    dense, ids, labels = _data(n=64)
    per = STEP_ROWS // world
    rows = slice(STEP_ROWS * step + rank * per, STEP_ROWS * step + (rank + 1) * per)
    loss, _ = step_loss(sm.model(dense[rows], _kjt(ids[rows])), labels[rows], torch.ones(per), float(STEP_ROWS), world)
    loss.backward()
    sm.optimizer.step()
    sm.optimizer.zero_grad()


def _predict(sm):
    dense, ids, _ = _data(n=64)
    with torch.no_grad():
        return sm.model(dense[:16], _kjt(ids[:16])).reshape(-1)


def _save_worker(rank, world, port, root):
    import torch.distributed as dist

    from recforge.train.recovery.resume import save_disk

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sm = _build(world)
        for s in range(3):
            _step(sm, rank, world, s)
        save_disk(sm.model, sm.optimizer, Path(root), 3, rank=rank, meta={"step": 3, "world_size": world}, keep=2)
        _step(sm, rank, world, 3)  # the step after the checkpoint, without it
        pred = _predict(sm)
        if rank == 0:
            torch.save(pred, Path(root) / "continued.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world1():
    """This process as a one-rank gloo group."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("ckpt2")
    mp.spawn(_save_worker, args=(2, free_port(), str(root)), nprocs=2)
    return root


def test_two_rank_checkpoint_continues_exactly_on_one_rank(world1, saved_by_two_ranks):
    from recforge.train.recovery.resume import load_latest

    sm = _build(1)
    before = _predict(sm)
    restored = load_latest(sm.model, sm.optimizer, rank=0, disk_root=saved_by_two_ranks, memory_root=None)
    assert restored is not None and restored.step == 3 and restored.meta["world_size"] == 2
    _step(sm, 0, 1, 3)
    got, want = _predict(sm), torch.load(saved_by_two_ranks / "continued.pt")
    assert (before - want).abs().max() > 1e-2  # the checkpoint moved the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # optimizer state came along, resharded


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(world1, tmp_path, caplog):
    from recforge.train.recovery.resume import load_latest, save_disk

    sm = _build(1)
    _step(sm, 0, 1, 0)
    save_disk(sm.model, sm.optimizer, tmp_path, 1, rank=0, meta={"step": 1, "world_size": 1}, keep=2)
    at_step_1 = _predict(sm)
    _step(sm, 0, 1, 1)
    save_disk(sm.model, sm.optimizer, tmp_path, 2, rank=0, meta={"step": 2, "world_size": 1}, keep=2)
    victim = tmp_path / "step-000000002" / "__0_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x55
    victim.write_bytes(bytes(raw))

    fresh = _build(1)
    with caplog.at_level(logging.WARNING, logger="recforge.train.recovery.resume"):
        restored = load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=tmp_path, memory_root=None)
    assert restored.step == 1
    assert restored.skipped == [(str(tmp_path / "step-000000002"), "__0_0.distcp sha256 mismatch")]
    assert any("step-000000002 (disk, step 2) is unusable: __0_0.distcp sha256 mismatch; "
               "falling back to the previous one" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(_predict(fresh), at_step_1)


def test_flash_fast_path_snapshot_loads_like_a_dcp_checkpoint(world1, tmp_path, caplog):
    """The second snapshot is written without DCP (bytes copied into the first one's layout); it must
    load through the DCP reader into exactly the state it was taken from, optimizer included. Once another user
    could write the directory, nothing in it is loaded (DCP unpickles) and no snapshot goes there."""
    from recforge.train.recovery.flash import FlashSnapshotter, private_flash_root
    from recforge.train.recovery.resume import load_latest, memory_problem

    sm = _build(1)
    snap = FlashSnapshotter(tmp_path, rank=0)
    _step(sm, 0, 1, 0)
    snap.save(sm.model, sm.optimizer, 1, {"step": 1, "world_size": 1})
    _step(sm, 0, 1, 1)
    snap.save(sm.model, sm.optimizer, 2, {"step": 2, "world_size": 1})
    assert (snap.full_saves, snap.fast_saves) == (1, 1)
    assert memory_problem(tmp_path / "step-000000002") is None
    at_2 = _predict(sm)
    _step(sm, 0, 1, 2)
    after_3 = _predict(sm)

    fresh = _build(1)
    restored = load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=None, memory_root=tmp_path)
    assert (restored.step, restored.source) == (2, "memory")
    torch.testing.assert_close(_predict(fresh), at_2)
    _step(fresh, 0, 1, 2)  # the optimizer state came back too: the next step matches
    torch.testing.assert_close(_predict(fresh), after_3, rtol=1e-5, atol=1e-6)
    snap.save(fresh.model, fresh.optimizer, 3, {"step": 3, "world_size": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002", "step-000000003"]  # older dropped

    os.chmod(tmp_path, 0o770)
    with caplog.at_level(logging.WARNING):
        assert load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=None, memory_root=tmp_path) is None
        assert private_flash_root(tmp_path, rank=0) is None  # the checkpointer saves to disk instead
    assert f"refusing flash checkpoint directory {tmp_path}: it is writable by group or others (mode 0770); " \
           f"loading from the disk checkpoints only" in caplog.text


def test_no_checkpoint_means_initial_weights(world1, tmp_path):
    from recforge.train.recovery.resume import load_latest

    sm = _build(1)
    before = _predict(sm)
    restored = load_latest(sm.model, sm.optimizer, rank=0, disk_root=tmp_path / "none", memory_root=tmp_path / "nomem")
    assert restored is None
    torch.testing.assert_close(_predict(sm), before)


class ListSource:
    """TaskBatches stand-in: fixed batches, then None."""

    def __init__(self, batches):
        self.batches, self.tasks_done, self.trained_rows = list(batches), 0, 0

    def next(self):
        return self.batches.pop(0) if self.batches else None

    def trained(self, batch):
        self.trained_rows += batch.real


def _batches(micro, rows=16):
    from recforge.train.loop.batches import Batch

    dense, ids, labels = _data(n=64)
    return [Batch(dense=dense[a:a + micro], sparse=_kjt(ids[a:a + micro]), labels=labels[a:a + micro],
                  weights=torch.ones(micro), real=micro) for a in range(0, rows, micro)]


def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch(world1):
    """Plain (data_parallel) kernels: 2 x 4 rows with accumulation == 1 x 8 rows, step for step."""
    from recforge.train.loop.accumulate import train_epoch_accumulated
    from recforge.train.loop.step_loop import LoopState, train_epoch

    ref = _build(1, fused=False, sharding="data_parallel")
    empty8 = _batches(8)[0]
    empty8.weights = torch.zeros(8)
    src = ListSource(_batches(8))
    train_epoch(ref, src, empty8, LoopState(), epoch=0, world_size=1, log_every=100)
    acc = _build(1, fused=False, sharding="data_parallel")
    empty4 = _batches(4)[0]
    empty4.weights = torch.zeros(4)
    state = LoopState()
    src4 = ListSource(_batches(4))
    stats = train_epoch_accumulated(acc, src4, empty4, state, epoch=0, world_size=1, log_every=100, accumulation=2)
    assert state.step == 2 and stats.samples == 16 and src4.trained_rows == src.trained_rows == 16
    untrained = _predict(_build(1, fused=False, sharding="data_parallel"))
    assert (_predict(ref) - untrained).abs().max() > 1e-2
    torch.testing.assert_close(_predict(acc), _predict(ref), rtol=1e-5, atol=1e-6)


def test_step_checkpoint_of_another_plan_is_skipped_for_the_previous_one(world1, tmp_path, caplog):
    """A newer step checkpoint whose model/plan fingerprint differs from this run's is not loaded: the resume
    falls back to the newest one that fits, naming the difference."""
    from recforge.train.recovery.layout import fingerprint
    from recforge.train.recovery.resume import load_latest, save_disk

    ours = fingerprint(_model_cfg().model_dump(mode="json"), TABLES, NUM_DENSE, {"features": ["a"]})
    theirs = fingerprint(_model_cfg().model_dump(mode="json"), TABLES, NUM_DENSE, {"features": ["b"]})
    sm = _build(1)
    _step(sm, 0, 1, 0)
    save_disk(sm.model, sm.optimizer, tmp_path, 1, rank=0, meta={"step": 1, "world_size": 1, "fingerprint": ours},
              keep=2)
    at_step_1 = _predict(sm)
    _step(sm, 0, 1, 1)
    save_disk(sm.model, sm.optimizer, tmp_path, 2, rank=0, meta={"step": 2, "world_size": 1, "fingerprint": theirs},
              keep=2)

    fresh = _build(1)
    with caplog.at_level(logging.WARNING, logger="recforge.train.recovery.resume"):
        restored = load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=tmp_path, memory_root=None,
                               fingerprint=ours)
    assert restored is not None and restored.step == 1
    [(path, why)] = restored.skipped
    assert path == str(tmp_path / "step-000000002") and why.startswith("another model or plan: ")
    assert "plan" in why
    torch.testing.assert_close(_predict(fresh), at_step_1)
    # without a fingerprint to check against (a caller that does not know its plan), integrity alone decides
    fresh = _build(1)
    assert load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=tmp_path, memory_root=None).step == 2


def test_nan_bytes_in_a_tensor_region_are_caught_by_the_checksum_and_not_loaded(world1, tmp_path, caplog):
    """One tensor's stored bytes overwritten with NaN (the file still parses, same size): the checksum names the
    file, the resume falls back to the previous checkpoint, the final-checkpoint loader refuses it."""
    from recforge.pipelines.faults import corrupt_nan_region
    from recforge.train.recovery.layout import CheckpointCorrupt, verify_checkpoint
    from recforge.train.recovery.resume import load_latest, save_disk

    sm = _build(1)
    _step(sm, 0, 1, 0)
    save_disk(sm.model, sm.optimizer, tmp_path, 1, rank=0, meta={"step": 1, "world_size": 1}, keep=2)
    at_step_1 = _predict(sm)
    _step(sm, 0, 1, 1)
    newest = save_disk(sm.model, sm.optimizer, tmp_path, 2, rank=0, meta={"step": 2, "world_size": 1}, keep=2)
    size_before = {p.name: p.stat().st_size for p in newest.iterdir()}
    region = corrupt_nan_region(newest)
    assert region.length >= 4 and {p.name: p.stat().st_size for p in newest.iterdir()} == size_before
    with pytest.raises(CheckpointCorrupt, match=f"{region.file.name} sha256 mismatch; refusing to load it"):
        verify_checkpoint(newest)

    fresh = _build(1)
    with caplog.at_level(logging.WARNING, logger="recforge.train.recovery.resume"):
        restored = load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=tmp_path, memory_root=None)
    assert restored.step == 1 and restored.skipped == [(str(newest), f"{region.file.name} sha256 mismatch")]
    torch.testing.assert_close(_predict(fresh), at_step_1)  # finite: the NaN bytes were never loaded


def test_a_full_checkpoint_directory_fails_the_save_clearly_and_leaves_nothing_loadable(world1, tmp_path):
    """The step checkpoints on a tmpfs with room for one: the second save fails with ENOSPC naming the file;
    no half-written checkpoint is ever a candidate, the resume loads the complete one."""
    from recforge.pipelines.faults import SpaceLimitUnavailable, small_filesystem
    from recforge.train.recovery.layout import candidates, disk_problem
    from recforge.train.recovery.resume import CheckpointSaveError, load_latest, save_disk

    sm = _build(1)
    probe = save_disk(sm.model, sm.optimizer, tmp_path / "probe", 1, rank=0, meta={"step": 1, "world_size": 1},
                      keep=2)
    one = sum(p.stat().st_size for p in probe.iterdir())
    try:
        with small_filesystem(tmp_path / "full", one * 3 // 2 + 65536) as root:
            _step(sm, 0, 1, 0)
            save_disk(sm.model, sm.optimizer, root, 1, rank=0, meta={"step": 1, "world_size": 1}, keep=2)
            at_step_1 = _predict(sm)
            _step(sm, 0, 1, 1)
            with pytest.raises(CheckpointSaveError) as err:
                save_disk(sm.model, sm.optimizer, root, 2, rank=0, meta={"step": 2, "world_size": 1}, keep=2)
            assert (f"step checkpoint {root / 'step-000000002'} could not be written (rank 0: OSError: [Errno 28] "
                    f"No space left on device") in str(err.value) and "partial save was removed" in str(err.value)
            assert sorted(p.name for p in root.iterdir()) == ["step-000000001"]  # the .tmp is gone
            assert [c.path.name for c in candidates(root, None)] == ["step-000000001"]
            assert disk_problem(root / "step-000000001") is None
            fresh = _build(1)
            restored = load_latest(fresh.model, fresh.optimizer, rank=0, disk_root=root, memory_root=None)
            assert restored.step == 1 and restored.skipped == []
            torch.testing.assert_close(_predict(fresh), at_step_1)
    except SpaceLimitUnavailable as e:
        pytest.skip(f"no size-limited directory here: {e}")
