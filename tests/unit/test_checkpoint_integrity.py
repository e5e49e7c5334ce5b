"""Checkpoint integrity and fingerprints on a real (tiny) final DCP checkpoint: 4 KiB of embedding bytes
overwritten fail the load naming the file; a checkpoint of another model / plan is refused with the reason; an
intact one loads the saved weights."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recforge.config import ModelConfig
from recforge.train.model import build_dlrm
from recforge.train.recovery.checkpoint import load_unsharded, save_checkpoint
from recforge.train.recovery.layout import (
    CHECKSUMS_FILE,
    DISK,
    CheckpointCorrupt,
    CheckpointIncompatible,
    check_compatible,
    checkpoint_problem,
    fingerprint,
    read_meta,
)

MODEL = ModelConfig(embedding_dim=8, dense_arch=[8], over_arch=[8, 1])
TABLES = [("C1", 200), ("C2", 7)]  # C1: 200 x 8 float32 = 6.4 KiB
PLAN = {"name": "p", "features": [{"name": "C1", "ops": [{"op": "sigrid_hash", "params": {"M": 200}}]}]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_dlrm(MODEL, TABLES, 3)
        fp = fingerprint(MODEL.model_dump(mode="json"), TABLES, 3, PLAN)
        path = save_checkpoint(model, None, root / "final", rank=0, meta={"world_size": 1, "fingerprint": fp})
    finally:
        dist.destroy_process_group()
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def copy_of(path, tmp_path):
    return shutil.copytree(path, tmp_path / "copy")


def embedding_range(path) -> tuple[str, int, int]:
    """(file, offset, length) of table C1's weights in the DCP data."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    for index, info in md.storage_data.items():
        if "embedding_bags.C1.weight" in index.fqn:
            return info.relative_path, info.offset, info.length
    raise AssertionError(f"no C1 weights in {sorted(i.fqn for i in md.storage_data)}")


def test_intact_final_checkpoint_loads_the_saved_weights(saved):
    path, weights = saved
    assert set(json.loads((path / CHECKSUMS_FILE).read_text())) >= {".metadata", "__0_0.distcp",
                                                                     "recforge_checkpoint.json"}
    model = load_unsharded(MODEL, TABLES, 3, path, plan=PLAN)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    assert checkpoint_problem(path, DISK, fingerprint(MODEL.model_dump(mode="json"), TABLES, 3, PLAN)) is None


def test_4kib_of_embedding_bytes_overwritten_fail_the_load_naming_the_file(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    name, offset, length = embedding_range(path)
    assert length >= 4096
    with open(path / name, "r+b") as f:  # same size: only the checksum can tell
        f.seek(offset + 64)
        f.write(bytes(4096))
    with pytest.raises(CheckpointCorrupt, match=rf"checkpoint {path}: {name} sha256 mismatch"):
        load_unsharded(MODEL, TABLES, 3, path, plan=PLAN)
    assert checkpoint_problem(path).startswith(f"{name} sha256 mismatch")  # the step-resume check says the same
    (path / CHECKSUMS_FILE).unlink()  # no checksums: never trusted
    with pytest.raises(CheckpointCorrupt, match="CHECKSUMS.json missing"):
        load_unsharded(MODEL, TABLES, 3, path)


def test_checkpoint_of_another_model_or_plan_is_refused_with_the_reason(saved):
    path, _ = saved
    other_plan = {"name": "p", "features": [{"name": "C1", "ops": [{"op": "sigrid_hash", "params": {"M": 100}}]}]}
    with pytest.raises(CheckpointIncompatible, match="preprocessing plan: checkpoint sha256"):
        load_unsharded(MODEL, TABLES, 3, path, plan=other_plan)
    with pytest.raises(CheckpointIncompatible, match=r"table 'C1': checkpoint 200 rows, this run 300"):
        load_unsharded(MODEL, [("C1", 300), ("C2", 7)], 3, path)
    wide = ModelConfig(embedding_dim=4, dense_arch=[4], over_arch=[8, 1])
    current = fingerprint(wide.model_dump(mode="json"), TABLES, 3, PLAN)
    why = check_compatible(read_meta(path), current)
    assert "model.embedding_dim: checkpoint 8, this run 4" in why and "model.dense_arch" in why
    # the step-resume path gets the same reason, so it falls back to an older checkpoint or scratch
    assert checkpoint_problem(path, DISK, current).startswith("another model or plan: model.dense_arch")
    assert "no model/plan fingerprint" in check_compatible({"world_size": 1}, current)
    assert check_compatible(read_meta(path), fingerprint(MODEL.model_dump(mode="json"), TABLES, 3,
                                                         {**PLAN, "name": "renamed"})) is None  # names do not count
