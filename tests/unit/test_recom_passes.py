"""Column analysis (graph -> ColumnProgram) and the column passes (RECom §5)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from recforge.recom.backend.column_compiler import compile_columns
from recforge.recom.columns.intervals import IntervalSet
from recforge.recom.columns.passes import PassLog, drop_implied_filters, ids_range, merge_filters, optimize
from recforge.recom.columns.program import Bucketize, Clamp, ColumnProgram, Mod, Remove, Replace, SigridHash, Src
from recforge.recom.family import make_features
from recforge.recom.frontend.capture import capture
from test_recom_columns_fixtures import compiled_columns, small_model
from test_recom_fixtures import build_inference, raw_batch, small_dataset


@pytest.fixture(scope="module")
def analyzed():
    m = small_model()
    cc = compiled_columns(m, make_features(m, 8, seed=0))
    return m, cc


def _entry(cc, kind: str, i: int = 0):
    return next(e for e in cc.report["per_column"] if f".{kind}_{i}." in e["table"])


def test_every_kind_is_read_and_fused(analyzed):
    _, cc = analyzed
    assert cc.report["fused"] == cc.report["columns"] == 16 and cc.report["residual"] == {}
    bucket = _entry(cc, "bucketized")
    assert "bucketize(K=" in bucket["graph"] and "clamp(0," in bucket["graph"] and "pool_mean" in bucket["graph"]
    assert "clamp" not in bucket["fused"] and "-> gather" in bucket["fused"]
    ih = _entry(cc, "int_hash")
    assert "replace(keep [0," in ih["graph"] and ih["fused"].count("->") == 2  # mod -> gather
    safe = _entry(cc, "multi_hot", 0)  # TF's safe_embedding_lookup_sparse port
    for piece in ("remove(keep [0, +inf])", "unique", "fill_empty(0)", "zero empty rows"):
        assert piece in safe["graph"]
    assert safe["fused"].endswith("by features_multi_hot_0_lengths") and "unique" not in safe["fused"]
    raw = _entry(cc, "raw_id")
    assert raw["graph"].count("replace(") == 2 and raw["fused"].count("replace(") == 1


def test_pass_counts_and_proofs(analyzed):
    _, cc = analyzed
    p = cc.report["passes"]
    assert p["gathers"] == 3  # the bucketized EmbeddingBag([B, 1]) lookups
    assert p["filters_merged"] == 2  # the two raw-id columns' consecutive guards
    assert p["filters_dropped"] == 3 + 2 + 2 + 3  # clamps, int-hash guards, string-hash clamps, safe prunes
    assert p["empty_row_rewrites"] == 6  # 3 safe columns: fill+zero, and unique
    assert cc.report["shapes"]["columns_share_batch"] is True
    assert cc.report["data_dependent_ops_removed"] > 0 and cc.report["shape_computations_removed"] > 0
    bounds = cc.report["shapes"]["graph_ids_upper_bounds"]
    assert bounds["embedding.columns.multi_hot_0.weight"] == "B + n_features_multi_hot_0"  # prune + fill


def test_dlrm_grouped_preprocessing_is_read_per_column():
    ds = small_dataset()
    inf = build_inference("dlrm", dataset=ds)
    cc = compile_columns(capture(inf.lowered(), raw_batch(ds, 8, seed=0)))
    assert cc.report["fused"] == len(ds.sparse)
    moduli = dict(inf.preprocess.plan.tables())
    for e in cc.report["per_column"]:
        feat = e["table"].split(".")[1].upper()
        assert "select(sparse_valid[:, " in e["graph"] and f"M={moduli[feat]})" in e["fused"]


def _prog(steps, rows=100, dtype="int64", **kw):
    return ColumnProgram(name="t", table="t", rows=rows, dim=4, value=Src("x", None, dtype), steps=tuple(steps),
                         lookup="gather", **kw)


def test_bucketize_range_includes_k():
    """[0, K], not RECom's [0, K): clamp(0, K - 1) changes the top bucket and must stay."""
    b = Bucketize((0.0, 1.0, 2.0))
    kept = drop_implied_filters(_prog([b, Clamp(0, 2)], dtype="float32"), PassLog())
    assert kept.steps == (b, Clamp(0, 2))
    gone = drop_implied_filters(_prog([b, Clamp(0, 3)], dtype="float32"), PassLog())
    assert gone.steps == (b,)


def test_guards_dropped_only_when_implied():
    log = PassLog()
    p = drop_implied_filters(
        _prog([Mod(10), Replace(IntervalSet.of((0, 9)), 0), Remove(IntervalSet.compare("ge", 0))]), log)
    assert p.steps == (Mod(10),) and len(log.dropped) == 2
    # a guard narrower than the range is a real filter: kept
    p = drop_implied_filters(_prog([Mod(10), Replace(IntervalSet.of((0, 4)), 0)]), PassLog())
    assert len(p.steps) == 2
    # nothing is implied about raw int64 input
    p = drop_implied_filters(_prog([Remove(IntervalSet.compare("ge", 0))]), PassLog())
    assert len(p.steps) == 1
    # the hash range makes `ids < M` redundant, not `ids < M - 1`
    p = drop_implied_filters(_prog([SigridHash(1, 50), Replace(IntervalSet.compare("lt", 49), 0)]), PassLog())
    assert len(p.steps) == 2


def test_merging_consecutive_filters():
    log = PassLog()
    p = merge_filters(_prog([Remove(IntervalSet.compare("ge", 0)), Remove(IntervalSet.compare("lt", 7))]), log)
    assert p.steps == (Remove(IntervalSet.of((0, 6))),) and len(log.merged) == 1
    p = merge_filters(_prog([Replace(IntervalSet.compare("ge", 0), 0), Replace(IntervalSet.compare("lt", 7), 1)]), log)
    assert len(p.steps) == 2  # different fill values: not one Replace
    p = merge_filters(_prog([Clamp(0, None), Clamp(None, 9)]), log)
    assert p.steps == (Clamp(0, 9),)
    p = merge_filters(_prog([Clamp(5, 9), Clamp(0, 3)]), log)
    assert len(p.steps) == 2  # disjoint clamps do not compose into one


def test_empty_rows_and_one_hot():
    log = PassLog()
    jag = _prog([SigridHash(0, 10)], lengths="l", fill_empty=0, zero_empty=True, unique=True).with_(lookup="pool")
    out = optimize(jag, log)
    assert out.fill_empty is None and not out.zero_empty and not out.unique and out.lookup == "pool"
    kept_default = optimize(_prog([SigridHash(0, 10)], lengths="l", fill_empty=3).with_(lookup="pool"), PassLog())
    assert kept_default.fill_empty == 3  # without the zeroing, an empty row really is row 3
    one = optimize(_prog([Mod(5)], one_id_proof="proof").with_(lookup="pool", mode="mean"), log)
    assert one.lookup == "gather"
    assert ids_range(one) == IntervalSet.of((0, 4))


class _Unmodeled(nn.Module):
    """A column whose translation uses an op the analysis does not model (abs): it must stay residual."""

    def __init__(self):
        super().__init__()
        self.a = nn.Embedding(10, 4)
        self.b = nn.Embedding(10, 4)

    def forward(self, x, y):
        return torch.cat([self.a(torch.remainder(x, 10)), self.b(torch.abs(y) % 10)], dim=1)


def test_unmodeled_op_leaves_the_column_residual():
    x = torch.tensor([1, -3, 25])
    cc = compile_columns(capture(_Unmodeled(), (x, x * 7)))
    assert cc.report["fused"] == 1
    (reason,) = cc.report["residual"].values()
    assert "abs" in reason


class _Broadcasting(nn.Module):
    """A [B, F, 1] grid plus a [F] constant broadcasts to [B, F, F]: not a per-feature step."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.tensor([1, 2]))
        self.a = nn.Embedding(10, 3)
        self.b = nn.Embedding(10, 3)

    def forward(self, x):  # x: [B, 2]
        y = (x.unsqueeze(-1) + self.offset).remainder(10)  # [B, 2, 2]
        return torch.cat([self.a(y[:, 0, 1]), self.b(y[:, 1, 0])], dim=1)


def test_broadcasting_grid_ops_are_not_read_per_column():
    from recforge.recom import check_against_eager
    from recforge.recom import compile as recom_compile

    mod = _Broadcasting()
    x = torch.tensor([[3, 4], [5, 9], [0, 1]])
    cc = compile_columns(capture(mod, (x,)))
    assert cc.report["fused"] == 0 and all("broadcasting changes the feature grid" in r
                                           for r in cc.report["residual"].values())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = recom_compile(mod, (x,), backend="export")
    assert check_against_eager(c, mod, (torch.tensor([[7, 8], [1, 2]]),)) == 0.0
