"""The flash checkpoint's fast path (recforge.train.recovery.flash_layout) against DCP itself, with a real sharded DLRM
(fused TBE tables: weights and optimizer states are views of flat buffers) on one gloo rank:

1. the bytes taken from a tensor are the bytes DCP writes for it (a clone's storage), for contiguous views at an
   offset, non-contiguous views, 0-dim, empty and odd dtypes;
2. a fast snapshot's data file is byte-for-byte the file DCP writes for the same state, but for each torch.save's
   fresh serialization id (every payload's CRC-32 in its zip records included: zipfile's testzip passes), and after
   the first save the layout keeps only the bytes around payloads (not a copy of the state);
3. the check after the first save compares every payload: one flipped byte fails it.
"""
from __future__ import annotations

import io
import re
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItemType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gloo_world import world1  # noqa: F401 (fixture)
from recforge.config import ModelConfig, TrainConfig
from recforge.train.model import build_dlrm
from recforge.train.recovery.flash import FlashSnapshotter
from recforge.train.recovery.flash_layout import Layout, RecordingWriter, _storage_bytes
from recforge.train.recovery.resume import training_state
from recforge.train.sharding import shard_model

pytestmark = pytest.mark.usefixtures("world1")  # one gloo rank (gloo_world)
TABLES = [("c0", 20_000), ("c1", 9_000), ("c2", 7)]  # the tables' bytes outweigh the zip headers
NUM_DENSE = 3
BATCH = 8


def _reference_bytes(t: torch.Tensor) -> bytes:
    """What DCP's torch.save writes for a tensor: the storage of its clone when it is a view, else its storage."""
    t = t.detach()
    if t.untyped_storage().size() != t.nbytes:
        t = t.clone()
    return bytes(t.untyped_storage())


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24, dtype=torch.float32),
    lambda: torch.arange(24, dtype=torch.float32)[5:17],  # contiguous view at an offset (a TBE table's weights)
    lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6)[1:3],
    lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, 1:4],  # not contiguous
    lambda: torch.arange(24, dtype=torch.float64).reshape(4, 6).t(),  # a whole storage, transposed
    lambda: torch.tensor(3.5),
    lambda: torch.empty(0, 4),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.arange(10, dtype=torch.bfloat16)[2:9],
    lambda: torch.arange(30, dtype=torch.int64).reshape(5, 6)[1:4, ::2],
], ids=["whole", "flat-view", "row-view", "col-view", "transposed", "0-dim", "empty", "bool", "bf16-view", "strided"])
def test_storage_bytes_are_what_dcp_writes(make):
    t = make()
    got = _storage_bytes(t)
    assert got.dtype == torch.uint8 and got.dim() == 1
    assert bytes(got.numpy()) == _reference_bytes(t)


def _model():
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), TABLES, NUM_DENSE)
    train = TrainConfig(batch_size=BATCH, fused_embeddings=True, sharding="table_wise", embedding_lr=0.2,
                        dense_lr=0.05)
    return shard_model(model, train, world_size=1, device=torch.device("cpu"))


def _step(sm, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, n, (BATCH,), generator=g) for _, n in TABLES])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[k for k, _ in TABLES], values=ids,
                                              lengths=torch.ones(BATCH * len(TABLES), dtype=torch.int32))
    out = sm.model(torch.randn(BATCH, NUM_DENSE, generator=g), kjt)
    torch.nn.functional.binary_cross_entropy_with_logits(
        out.reshape(-1), torch.randint(0, 2, (BATCH,), generator=g).float()).backward()
    sm.optimizer.step()
    sm.optimizer.zero_grad()


def _data_file(path: Path) -> bytes:
    (f,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    return f.read_bytes()


def _tensor_zips(data: bytes, recorded) -> list[zipfile.ZipFile]:
    """Each tensor item's torch.save zip inside a rank's data file, at the offsets DCP recorded."""
    return [zipfile.ZipFile(io.BytesIO(data[r.storage_data.offset: r.storage_data.offset + r.storage_data.length]))
            for item, r in recorded if item.type != WriteItemType.BYTE_IO]


def _id_ranges(data: bytes, recorded) -> list[range]:
    """Where each torch.save zip holds `.data/serialization_id`: a fresh id per save, the one byte range in which
    two saves of the same state differ."""
    out = []
    for item, r in recorded:
        if item.type == WriteItemType.BYTE_IO:
            continue
        base = r.storage_data.offset
        with zipfile.ZipFile(io.BytesIO(data[base: base + r.storage_data.length])) as zf:
            (info,) = [i for i in zf.infolist() if i.filename.endswith(".data/serialization_id")]
            blob = data[base: base + r.storage_data.length]
            n, x = struct.unpack("<HH", blob[info.header_offset + 26: info.header_offset + 30])
            start = base + info.header_offset + 30 + n + x
            out.append(range(start, start + info.file_size))
            # its CRC-32 (data descriptor and central directory) moves with it
            out.extend(range(base + p, base + p + 4) for p in _crc_fields(blob, info))
    return out


def _crc_fields(blob: bytes, info: zipfile.ZipInfo) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(struct.pack("<I", info.CRC)), blob)]


def test_a_fast_snapshot_is_byte_for_byte_the_dcp_file(tmp_path):
    sm = _model()
    _step(sm, 0)
    snap = FlashSnapshotter(tmp_path / "flash", rank=0)
    snap.save(sm.model, sm.optimizer, 1, {"step": 1})
    layout = snap.layout
    assert layout is not None and layout.segments is not None and layout.buffer == b""  # the state's bytes not kept
    kept = sum(len(seg) for seg in layout.segments if isinstance(seg, bytes))
    filled = sum(it.length + 4 * len(it.crc_at) for it in layout.items)
    assert kept + filled == layout.size and kept < layout.size / 4
    assert all(len(it.crc_at) >= 2 for it in layout.items if not it.is_bytes)
    for seed in (1, 2):
        _step(sm, seed)  # new weights and optimizer states, the same layout
        step = 1 + seed
        snap.save(sm.model, sm.optimizer, step, {"step": step})
        reference = tmp_path / f"dcp-{step}"
        writer = RecordingWriter(str(reference))
        dcp.save(training_state(sm.model, sm.optimizer), storage_writer=writer)
        fast, want = _data_file(tmp_path / "flash" / f"step-{step:09d}"), _data_file(reference)
        assert len(fast) == len(want)
        for zf in _tensor_zips(fast, writer.recorded):  # every entry's CRC-32 is its bytes' (the payloads' refilled)
            assert zf.testzip() is None
        ids = _id_ranges(want, writer.recorded)
        differ = [i for i in range(len(want)) if fast[i] != want[i]]
        uncovered = [i for i in differ if not any(i in r for r in ids)]
        assert differ and not uncovered, uncovered[:8]
        # (the `.metadata` is the first save's, reused: it names that save's path and id; loading a fast snapshot
        # through DCP's reader is tests/integration/test_fault_checkpoint.py's)
    assert (snap.full_saves, snap.fast_saves) == (1, 2)


def test_the_check_after_the_first_save_catches_one_wrong_byte(tmp_path):
    sm = _model()
    _step(sm, 0)
    state = training_state(sm.model, sm.optimizer)
    writer = RecordingWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer)
    assert Layout(tmp_path, writer.recorded).verify(state)
    probe = Layout(tmp_path, writer.recorded)
    biggest = max((it for it in probe.items if not it.is_bytes), key=lambda it: it.length)
    probe.keep_headers_only()
    (data,) = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    raw = bytearray(data.read_bytes())
    raw[biggest.start + biggest.length // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert not Layout(tmp_path, writer.recorded).verify(state)
