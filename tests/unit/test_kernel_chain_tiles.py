"""recforge_cpu::chain's row tiles: the single-pass kernel transposes each row tile's columns into tile buffers and
streams its outputs; every feature must give the same bits whatever rows, tile edges and column subsets it sees."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from recforge.preprocess.executors.chain import chain_program
from recforge.preprocess.presets import load_plan, preset_dataset
from recforge.preprocess.synth import random_raw_batch
from recforge_kernels import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.load(), reason="the C++ kernels did not build")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _feature_outputs(prog, dense: torch.Tensor, ids: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Each feature's output column, in program order."""
    out = []
    for kind, slot in zip(prog.out_kind, prog.out_slot, strict=True):
        out.append(_bits(dense[:, slot].contiguous()) if kind == 0 else ids[slot * rows:(slot + 1) * rows])
    return out


def _subset(prog, keep: list[int]):
    """The program of features `keep` (repeats allowed), each writing its own new slot."""
    fields: dict = {k: [] for k in ("src_kind", "src_col", "out_kind", "out_slot", "codes", "f0", "f1", "i0", "i1")}
    offsets, nd, ns = [0], 0, 0
    for f in keep:
        a, b = prog.step_offsets[f], prog.step_offsets[f + 1]
        for k in ("codes", "f0", "f1", "i0", "i1"):
            fields[k].extend(getattr(prog, k)[a:b])
        offsets.append(len(fields["codes"]))
        for k in ("src_kind", "src_col", "out_kind"):
            fields[k].append(getattr(prog, k)[f])
        if prog.out_kind[f] == 0:
            fields["out_slot"].append(nd)
            nd += 1
        else:
            fields["out_slot"].append(ns)
            ns += 1
    return dataclasses.replace(prog, step_offsets=offsets, num_dense=nd, num_sparse=ns, **fields)


@pytest.mark.parametrize("name", ["plan0", "plan3"])
@pytest.mark.parametrize("rows", [1, 31, 129, 300])
def test_row_counts_across_tile_edges_match_one_row_at_a_time(name: str, rows: int) -> None:
    prog = chain_program(load_plan(name), preset_dataset(name))
    raw = random_raw_batch(preset_dataset(name), rows, seed=rows)
    dense, ids = prog.run(raw)
    assert dense.shape == (rows, prog.num_dense) and ids.shape == (prog.num_sparse * rows,)
    for r in (0, rows // 2, rows - 1):  # a one-row batch is one partial tile
        one = dataclasses.replace(raw, dense=raw.dense[r:r + 1], dense_valid=raw.dense_valid[r:r + 1],
                                  sparse=raw.sparse[r:r + 1], sparse_valid=raw.sparse_valid[r:r + 1])
        d1, i1 = prog.run(one)
        assert torch.equal(_bits(d1[0]), _bits(dense[r]))
        assert torch.equal(i1, ids.view(prog.num_sparse, rows)[:, r])


def test_a_subset_of_columns_read_twice_gives_each_features_bits() -> None:
    prog = chain_program(load_plan("plan0"), preset_dataset("plan0"))
    raw = random_raw_batch(preset_dataset("plan0"), 1000, seed=3)
    dense, ids = prog.run(raw)
    full = _feature_outputs(prog, dense, ids, 1000)
    keep = [len(prog.src_kind) - 1, 3, 0, 3, 20]  # out of column order, one feature (column) twice
    sub = _subset(prog, keep)
    sub_dense, sub_ids = sub.run(raw)
    got = _feature_outputs(sub, sub_dense, sub_ids, 1000)
    for f, g in zip(keep, got, strict=True):
        assert torch.equal(g, full[f]), f


def test_no_rows_gives_empty_outputs() -> None:
    prog = chain_program(load_plan("plan0"), preset_dataset("plan0"))
    raw = random_raw_batch(preset_dataset("plan0"), 0, seed=0)
    dense, ids = prog.run(raw)
    assert dense.shape == (0, prog.num_dense) and ids.numel() == 0
