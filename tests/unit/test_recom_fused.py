"""recforge.recom.compile on massive-column models: fused embedding layer + residual dense net vs eager."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import recforge.recom as recom
from recforge.recom import check_against_eager
from recforge.recom.family import EmbeddingLayer, make_features, select_rows
from recforge.recom.family.columns import IntHashColumn, MultiHotColumn, RawIdColumn
from recforge.recom.frontend.graph_stats import dispatched_ops
from test_recom_columns_fixtures import eager, small_model

SYNC_OPS = ("nonzero", "_unique2", "_local_scalar_dense", "item", "repeat_interleave", "index.Tensor")


@pytest.fixture(scope="module")
def model_pair():
    m = small_model()
    c = recom.compile(m, (make_features(m, 8, seed=0),), backend="export")
    return m, c


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_whole_model_matches_eager(model_pair, rows):
    m, c = model_pair
    f = make_features(m, rows, seed=100 + rows, max_bag=5, empty_rate=0.3)
    assert check_against_eager(c, m, (f,), atol=1e-5) <= 1e-5
    assert c(f).shape == (rows,)


def test_everything_fused_and_concat_written_in_place(model_pair):
    m, c = model_pair
    meta = c.metadata
    assert c.fused and meta["recom"]["fused"] == meta["recom"]["columns"] == 16
    assert meta["recom_status"] == "16 of 16 columns fused"
    assert meta["onednn_linears"] == 3  # bottom, top, head
    dense = c.exported_program.graph
    embeddings = [n for n in dense.nodes if n.op == "call_function"
                  and ("embedding" in str(n.target) or "bucketize" in str(n.target))]
    assert embeddings == []
    cats = [n for n in dense.nodes if n.target is torch.ops.aten.cat.default]
    assert len(cats) == 1 and "recom_embedding" in [a.name for a in cats[0].args[0]]  # [bottom(dense), emb]
    assert meta["ops_compiled"] < meta["ops_before"] / 10


def test_no_data_dependent_ops_or_syncs_in_the_compiled_forward(model_pair):
    m, c = model_pair
    f = make_features(m, 16, seed=3)
    ops = dispatched_ops(c, (f,))
    assert not [o for o in ops if any(s in o for s in SYNC_OPS)]
    assert ops["recforge.embedding_layer.default"] == 1
    eager_ops = dispatched_ops(m, (f,))
    assert any("_unique2" in o or "nonzero" in o for o in eager_ops)  # the TF-style columns sync in eager


def test_jagged_edge_cases(model_pair):
    m, c = model_pair
    f = make_features(m, 9, seed=4)
    for k in list(f):
        if k.endswith("_lengths"):
            f[k] = torch.zeros_like(f[k])  # every bag empty
            f[k[: -len("_lengths")]] = f[k[: -len("_lengths")]][:0]
    assert check_against_eager(c, m, (f,), atol=1e-5) <= 1e-5
    g = make_features(m, 9, seed=5)
    name = next(k for k in g if "bucketized" in k)
    g[name][::2] = float("nan")  # NaN -> bucket K, as torch.bucketize
    assert check_against_eager(c, m, (g,), atol=1e-5) <= 1e-5


def test_row_subsets_give_the_same_rows(model_pair):
    m, c = model_pair
    f = make_features(m, 20, seed=6)
    full = c(f)
    torch.testing.assert_close(c(select_rows(f, [19, 4, 4])), full[[19, 4, 4]], rtol=0, atol=1e-6)


def test_lengths_that_disagree_with_values_are_value_errors(model_pair):
    m, c = model_pair
    f = make_features(m, 5, seed=7)
    key = next(k for k in f if k.endswith("_lengths"))
    f[key] = f[key].clone()
    f[key][0] += 1
    with pytest.raises(ValueError, match="lengths sum to .* but it has .* values .*column 'embedding.columns"):
        c(f)


def test_inputs_of_another_structure_are_refused(model_pair):
    m, c = model_pair
    f = make_features(m, 5, seed=8)
    f.pop("dense")
    with pytest.raises(ValueError, match="structure"):
        c(f)


def test_ids_out_of_range_raise_index_error_as_eager():
    torch.manual_seed(0)
    layer = EmbeddingLayer({"ok": IntHashColumn(20, 4), "raw": RawIdColumn(7, 4, oov="error")})
    good = {"ok": torch.tensor([5, -3, 44]), "raw": torch.tensor([0, 6, 3])}
    c = recom.compile(layer, (good,), backend="export")
    assert c.metadata["recom"]["plan"]["bounds_checked_columns"] == ["columns.raw.embedding.weight"]
    assert check_against_eager(c, layer, (good,)) == 0.0
    bad = {"ok": torch.tensor([1, 2]), "raw": torch.tensor([0, 7])}
    with pytest.raises(IndexError):
        eager(layer, bad)
    with pytest.raises(IndexError, match="id 7 outside its table of 7 rows.*columns.raw"):
        c(bad)


class _RawBag(nn.Module):
    """A pooled lookup of raw ids (no hash, no guard): nothing proves them inside the table."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim))

    def forward(self, values, lengths):
        return nn.functional.embedding_bag(values, self.weight, torch.cumsum(lengths, 0) - lengths, mode="sum")


class _RawModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.emb = _RawBag(6, 4), nn.Embedding(5, 3)

    def forward(self, values, lengths, x):
        return torch.cat([self.bag(values, lengths), self.emb(x)], dim=1)


def test_pooled_and_gathered_ids_out_of_range_fail_as_eager():
    torch.manual_seed(0)
    m = _RawModel().eval()
    good = (torch.tensor([0, 5, 2, 3]), torch.tensor([2, 0, 2]), torch.tensor([1, 2, 4]))
    c = recom.compile(m, good, backend="export")
    assert sorted(c.metadata["recom"]["plan"]["bounds_checked_columns"]) == ["bag.weight", "emb.weight"]
    assert check_against_eager(c, m, good) == 0.0
    bag_bad = (torch.tensor([0, 6, 2, 3, 1]), torch.tensor([2, 0, 3]), torch.tensor([1, 2, 4]))
    with pytest.raises(RuntimeError):  # eager's embedding_bag
        m(*bag_bad)
    with pytest.raises(RuntimeError, match="id 6 outside its table of 6 rows.*'bag.weight'"):
        c(*bag_bad)
    emb_bad = (torch.tensor([0, 1, 2, 3]), torch.tensor([2, 0, 2]), torch.tensor([1, -1, 4]))
    with pytest.raises(IndexError):  # eager's embedding
        m(*emb_bad)
    with pytest.raises(IndexError, match="id -1 outside its table of 5 rows.*'emb.weight'"):
        c(*emb_bad)
    assert check_against_eager(c, m, good) == 0.0  # a failed call leaves nothing behind


def test_batches_and_bags_far_beyond_the_example(model_pair):
    m, c = model_pair  # compiled on 8 rows of at most 10 ids
    f = make_features(m, 300, seed=8, max_bag=60, empty_rate=0.05)
    assert max(int(v.max()) for k, v in f.items() if k.endswith("_lengths")) > 40
    assert check_against_eager(c, m, (f,), atol=1e-5) <= 1e-5


def test_save_load_round_trip(model_pair, tmp_path):
    m, c = model_pair
    path = c.save(tmp_path / "a" / "model.recom")
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.recom"]
    loaded = recom.load(path)
    assert loaded.fused and loaded.backend == "export" and loaded.metadata["recom"]["fused"] == 16
    for rows in (1, 33):
        f = make_features(m, rows, seed=rows)
        torch.testing.assert_close(loaded(f), c(f), rtol=0, atol=0)


def test_model_without_columns_is_compiled_as_captured():
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="no embedding columns found"):
        c = recom.compile(net, (x,), backend="export")
    assert not c.fused and c.metadata["recom_status"] == "no embedding columns found"
    assert check_against_eager(c, net, (torch.randn(9, 4),)) <= 1e-6


class _HalfUnmodeled(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = MultiHotColumn(30, 4, combiner="mean", salt=3)
        self.odd = nn.Embedding(10, 4)

    def forward(self, values, lengths, x):
        return torch.cat([self.bag(values, lengths), self.odd(torch.abs(x) % 10)], dim=1)


def test_unfused_columns_run_in_the_residual_graph():
    torch.manual_seed(0)
    mod = _HalfUnmodeled()
    args = (torch.randint(-9, 9, (6,)), torch.tensor([2, 0, 4]), torch.tensor([-4, 3, 12]))
    c = recom.compile(mod, args, backend="export")
    assert c.metadata["recom"]["fused"] == 1 and list(c.metadata["recom"]["residual"]) == ["odd.weight"]
    more = (torch.randint(-9, 9, (11,)), torch.tensor([5, 0, 0, 6]), torch.tensor([-1, 3, 12, 7]))
    assert check_against_eager(c, mod, more) <= 1e-6


def test_out_of_bounds_policies():
    m = small_model(multi_hot=0, large_multi_hot=0)
    f = make_features(m, 6, seed=0)
    empty = select_rows(f, [])
    strict = recom.compile(m.embedding, (f,), backend="export")
    with pytest.raises(ValueError, match=r"batch of 0 rows is outside the compiled bounds \[1, inf\]"):
        strict(empty)
    lenient = recom.compile(m.embedding, (f,), backend="export", out_of_bounds="eager")
    with pytest.warns(UserWarning, match="running the eager module"):
        assert lenient(empty).shape == (0, m.embedding.output_dim)
    static = recom.compile(m.embedding, (f,), dynamic_batch=False, backend="export", out_of_bounds="recompile")
    g = make_features(m, 4, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check_against_eager(static, m.embedding, (g,)) == 0.0
    assert static.metadata["recompiles"] == 1
    with pytest.raises(ValueError, match="out_of_bounds"):
        recom.compile(m.embedding, (f,), out_of_bounds="maybe")


def test_falls_back_to_the_captured_graph_when_the_kernel_cannot_build(monkeypatch):
    from recforge.recom.backend.layer import FusedEmbeddingLayer

    def no_toolchain(self, flat_inputs):
        raise RuntimeError("Error building extension 'recforge_embedding': g++ not found")

    monkeypatch.setattr(FusedEmbeddingLayer, "forward", no_toolchain)
    m = small_model(multi_hot=0, large_multi_hot=0)
    f = make_features(m, 6, seed=0)
    with pytest.warns(UserWarning, match="fused kernel is unavailable .*g\\+\\+ not found"):
        c = recom.compile(m, (f,), backend="export")
    assert not c.fused and c.metadata["recom"]["fused"] == 9  # the plan was made; only the kernel is missing
    assert check_against_eager(c, m, (make_features(m, 5, seed=1),)) <= 1e-6
