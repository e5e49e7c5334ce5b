"""The compiled model as an MLflow pyfunc, registered next to the trained model (real SQLite store)."""
from __future__ import annotations

import pytest
import torch

import recforge.recom as recom
from recforge.recom.serving import register_compiled
from recforge.tracking import TrackingStore
from recforge.tracking.recom_models import compiled_name, load_compiled
from test_recom_fixtures import build_inference, raw_batch, small_dataset


def test_register_load_predict(recforge_home, tmp_path):
    ds = small_dataset()
    eager = build_inference("dlrm", dataset=ds)
    compiled = recom.compile(eager.lowered(), raw_batch(ds, 16, seed=0), backend="export")
    path = compiled.save(tmp_path / "inference.pt2")
    store = TrackingStore()
    run_id = store.stage_run("exp", "day1", "compile")
    diff = compiled.metadata["example_max_abs_diff"]
    version = register_compiled(store, run_id, path, "recforge-dlrm", max_abs_diff=diff, atol=1e-5)
    assert register_compiled(store, run_id, path, "recforge-dlrm", max_abs_diff=diff, atol=1e-5) == version
    mv = store.client.get_model_version(compiled_name("recforge-dlrm"), version)
    assert mv.tags["trained_model"] == "recforge-dlrm" and float(mv.tags["max_abs_diff"]) <= 1e-5

    pyfunc = load_compiled(store, "recforge-dlrm", version)
    batch = raw_batch(ds, 7, seed=3)
    names = compiled.input_names
    assert names == ["dense", "dense_valid", "sparse", "sparse_valid"]
    got = pyfunc.predict({n: t.numpy() for n, t in zip(names, batch, strict=True)})
    with torch.no_grad():
        want = eager(*batch)
    torch.testing.assert_close(torch.as_tensor(got), want, rtol=0, atol=1e-5)
    with pytest.raises(KeyError, match="sparse_valid"):
        pyfunc.predict({n: t.numpy() for n, t in zip(names[:3], batch, strict=False)})  # sparse_valid left out


def test_a_mismatching_model_is_not_registered(recforge_home, tmp_path):
    store = TrackingStore()
    run_id = store.stage_run("exp", "day2", "compile")
    with pytest.raises(ValueError, match="not registering"):
        register_compiled(store, run_id, tmp_path / "none.pt2", "recforge-dlrm", max_abs_diff=1e-3, atol=1e-5)
    assert store.client.search_model_versions(f"name = '{compiled_name('recforge-dlrm')}'") == []
