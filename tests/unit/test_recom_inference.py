"""InferenceModule (eager, torchrec KJT path) vs its gather form, and the one-hot proof that gates lowering."""
from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recforge.preprocess.module import PreprocessModule
from recforge.recom import GatherInferenceModule, InferenceModule, NotOneHotError, UnsupportedModelError
from recforge.recom.columns.onehot import prove_one_hot
from test_recom_fixtures import build_inference, make_dlrm, plan_with_firstx, raw_batch, small_dataset


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_gather_form_matches_eager(arch):
    ds = small_dataset()
    inf = build_inference(arch, dataset=ds)
    low = inf.lowered()
    assert isinstance(low, GatherInferenceModule)
    inputs = raw_batch(ds, 37, seed=1)
    with torch.no_grad():
        want, got = inf(*inputs), low(*inputs)
    assert want.shape == got.shape == (37,) and got.dtype == torch.float32
    assert bool(((got > 0) & (got < 1)).all())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_eager_path_is_the_dlrm_on_preprocessed_ids():
    """sigmoid(DLRM(dense, KJT)) with the KJT built independently, feature by feature, from the ids."""
    ds = small_dataset()
    inf = build_inference("dlrm", dataset=ds)
    inputs = raw_batch(ds, 6, seed=2)
    with torch.no_grad():
        dense, ids = inf.preprocess(*inputs)
        kjt = KeyedJaggedTensor.from_jt_dict({
            name: JaggedTensor(values=ids[:, j], lengths=torch.ones(6, dtype=torch.int32))
            for j, name in enumerate(inf.feature_names)
        })
        want = torch.sigmoid(inf.dlrm(dense, kjt)).squeeze(1)
        torch.testing.assert_close(inf(*inputs), want, rtol=0, atol=0)
    assert ids.shape == (6, len(ds.sparse))
    assert inf.feature_names == [f"C{i + 1}" for i in range(len(ds.sparse))]


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_table_order_differs_from_feature_order(pooling):
    """EBC tables listed in reverse: each gather must still read its own feature's ids column."""
    ds = small_dataset()
    inf = build_inference("dlrm", dataset=ds, reverse_tables=True, pooling=pooling)
    assert [c.input_index for c in inf.columns] == list(range(len(ds.sparse)))[::-1]
    inputs = raw_batch(ds, 23, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(inf.lowered()(*inputs), inf(*inputs), rtol=0, atol=1e-6)


def test_gather_form_shares_the_weight_tensors():
    inf = build_inference("dlrm_dcn")
    low = inf.lowered()
    ebc = inf.dlrm.sparse_arch.embedding_bag_collection
    for col in low.columns:
        assert low.tables[col.table].weight is ebc.embedding_bags[col.table].weight
    source = {id(p) for p in inf.parameters()}
    assert {id(p) for p in low.parameters()} <= source
    assert low.num_tables == len(inf.columns) == len(small_dataset().sparse)


@pytest.mark.parametrize("x", [2, 5])
def test_refuses_firstx_other_than_one(x):
    ds = small_dataset()
    inf = build_inference("dlrm", dataset=ds, plan=plan_with_firstx(ds, x))
    with pytest.raises(NotOneHotError, match=rf"feature 'C1': firstx\({x}\) keeps up to {x} ids"):
        inf.lowered()
    with pytest.raises(NotOneHotError):
        inf.to_gather_form()


def test_without_firstx_one_hot_only_from_scalar_sources():
    ds = small_dataset()
    plan = plan_with_firstx(ds, None)
    names = [f.name for f in ds.sparse]
    with pytest.raises(NotOneHotError, match="no firstx op"):  # a source that may hold many ids per row
        prove_one_hot(plan, names)
    assert all("scalar source" in p for p in prove_one_hot(plan, names, scalar_sources=True).values())
    inf = build_inference("dlrm", dataset=ds, plan=plan)  # PreprocessModule reads one value per row
    assert PreprocessModule.scalar_sources
    inputs = raw_batch(ds, 9, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(inf.lowered()(*inputs), inf(*inputs), rtol=0, atol=1e-6)


def test_refuses_when_preprocessing_has_no_plan():
    ds = small_dataset()
    real = build_inference("dlrm", dataset=ds)

    class Opaque(torch.nn.Module):  # same outputs, no plan to prove anything from
        def __init__(self, inner: PreprocessModule):
            super().__init__()
            self.inner = inner

        def forward(self, *raw):
            return self.inner(*raw)

    inf = InferenceModule(Opaque(real.preprocess), real.dlrm, feature_names=real.feature_names)
    with torch.no_grad():
        torch.testing.assert_close(inf(*raw_batch(ds, 4, 0)), real(*raw_batch(ds, 4, 0)))
    with pytest.raises(NotOneHotError, match="has no `plan`"):
        inf.lowered()


def test_prove_one_hot_names_each_feature():
    ds = small_dataset()
    proofs = prove_one_hot(plan_with_firstx(ds, 1), [f.name for f in ds.sparse])
    assert sorted(proofs) == sorted(f.name for f in ds.sparse)
    with pytest.raises(NotOneHotError, match="'I1': not a sparse feature"):
        prove_one_hot(plan_with_firstx(ds, 1), ["I1"])


def test_rejects_a_table_for_a_feature_the_plan_does_not_produce():
    ds = small_dataset()
    inf = build_inference("dlrm", dataset=ds)
    dlrm = make_dlrm("dlrm", [("C1", 10), ("Cx", 10)], len(ds.dense))
    with pytest.raises(UnsupportedModelError, match="'Cx'"):
        InferenceModule(inf.preprocess, dlrm)


def test_refuses_a_table_smaller_than_the_plan_id_range():
    ds = small_dataset()
    inf = build_inference("dlrm", dataset=ds)
    tables = [(name, rows - 1 if name == "C3" else rows) for name, rows in inf.preprocess.plan.tables()]
    small = InferenceModule(inf.preprocess, make_dlrm("dlrm", tables, len(ds.dense)))
    with pytest.raises(UnsupportedModelError,
                       match=r"feature 'C3': the plan makes ids in \[0, 50\) but table 't_C3' has 49"):
        small.lowered()


def test_rejects_a_non_dlrm():
    inf = build_inference("dlrm")
    with pytest.raises(UnsupportedModelError, match="not a torchrec DLRM"):
        InferenceModule(inf.preprocess, torch.nn.Linear(3, 1))
