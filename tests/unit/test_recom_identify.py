"""Column identification (RECom Alg. 1) on exported graphs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recforge.recom.family import make_features
from recforge.recom.frontend.capture import capture
from recforge.recom.frontend.identify import identify_columns
from test_recom_columns_fixtures import SMALL, small_model
from test_recom_fixtures import build_inference, raw_batch, small_dataset

aten = torch.ops.aten


def test_one_column_per_table_converging_at_the_concat():
    m = small_model()
    cap = capture(m, (make_features(m, 8, seed=0),))
    cs = identify_columns(cap.program)
    assert len(cs.columns) == SMALL.num_columns == len(cs.tables)
    conv = {c.convergence[0] for c in cs.columns}
    assert len(conv) == 1 and next(iter(conv)).target is aten.cat.default
    placeholders = {n.name for n in cap.program.graph.nodes if n.op == "placeholder"}
    for col in cs.columns:
        assert col.output is not None and col.output in col.nodes
        inputs = [n for n in col.nodes if n.op == "placeholder" and n.name in cap.input_names]
        data = {n.name for n in inputs if any(u in col.nodes and u.target is not aten.sym_size.int for u in n.users)}
        assert 1 <= len(data) <= 2, (col.table, data)  # its raw input (and lengths); shape-only reads aside
        assert "features_dense" not in data
        assert {n.name for n in col.nodes if n.name in cs.tables} == {col.table}
    dense = cs.dense_nodes(cap.program.graph)
    assert any(n.target is aten.linear.default for n in dense)
    assert not any(n.target in (aten.embedding.default, aten.bucketize.Tensor) for n in dense)
    assert set(cs.tables) <= placeholders


def test_shared_preprocessing_belongs_to_every_column():
    """torchrec DLRM in gather form: one grouped preprocessing op feeds all 6 columns, which converge at a stack."""
    ds = small_dataset()
    cap = capture(build_inference("dlrm", dataset=ds).lowered(), raw_batch(ds, 8, seed=0))
    cs = identify_columns(cap.program)
    assert len(cs.columns) == len(ds.sparse)
    shared = set.intersection(*(c.nodes for c in cs.columns))
    assert any(str(n.target) == "recforge.sigrid_hash_multi.default" for n in shared)
    assert {c.convergence[0].target for c in cs.columns} == {aten.stack.default}
    assert not any("over_arch" in n.name or n.target is aten.linear.default for c in cs.columns for n in c.nodes)


class _TiedWeight(nn.Module):
    """A weight used as an embedding table and by a matmul: not a table (RECom: tables feed only lookups)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 4))
        self.t = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids, x):
        a = F.embedding(ids, self.w)
        b = F.embedding(ids, self.t)
        return torch.cat([a, b, x @ self.w.t()[:, :4]], dim=1)


def test_weights_used_outside_lookups_are_not_tables():
    cap = capture(_TiedWeight(), (torch.tensor([1, 2, 3]), torch.randn(3, 4)))
    cs = identify_columns(cap.program)
    assert [c.target for c in cs.columns] == ["t"]
    assert "p_w" in cs.rejected_weights and "also by" in cs.rejected_weights["p_w"]


def test_model_without_tables_has_no_columns():
    cap = capture(nn.Linear(4, 2), (torch.randn(3, 4),))
    cs = identify_columns(cap.program)
    assert cs.columns == [] and cs.tables == {}
