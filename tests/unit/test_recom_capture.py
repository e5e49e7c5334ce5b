"""Capture with torch.export: one dynamic batch Dim, a Dim per jagged input, tiling of a 1-row example."""
from __future__ import annotations

import pytest
import torch

from recforge.recom.family import make_features, select_rows
from recforge.recom.frontend.capture import CaptureError, capture
from test_recom_columns_fixtures import eager, small_model


@pytest.fixture(scope="module")
def model_and_capture():
    m = small_model()
    return m, capture(m, (make_features(m, 8, seed=0),))


def test_dynamic_dims(model_and_capture):
    m, cap = model_and_capture
    dims = cap.dynamic_dims
    batch = {dims[n] for n in cap.input_names if not n.endswith(("multi_hot_0", "multi_hot_1", "multi_hot_2",
                                                                    "multi_hot_3", "multi_hot_4", "multi_hot_5"))}
    assert batch == {cap.batch_symbol}
    jagged = [n for n in cap.input_names if "multi_hot" in n and not n.endswith("_lengths")]
    jagged_dims = {dims[n] for n in jagged}
    assert len(jagged) == 7 and len(jagged_dims) == 7 and cap.batch_symbol not in jagged_dims
    assert cap.batch_size == 8 and cap.export_s > 0


@pytest.mark.parametrize("rows", [2, 5, 31])
def test_captured_program_runs_other_batches_and_lengths(model_and_capture, rows):
    m, cap = model_and_capture
    f = make_features(m, rows, seed=rows, max_bag=6)
    torch.testing.assert_close(cap.program.module()(f), eager(m, f), rtol=0, atol=1e-6)


def test_one_row_example_is_tiled_and_stays_dynamic():
    m = small_model(multi_hot=0, large_multi_hot=0)
    f = make_features(m, 1, seed=0)
    cap = capture(m, (f,))
    assert cap.notes and "tiled" in cap.notes[0]
    g = make_features(m, 6, seed=1)
    torch.testing.assert_close(cap.program.module()(g), eager(m, g), rtol=0, atol=1e-6)


def test_too_short_jagged_example_is_an_error():
    m = small_model(safe_fraction=0.0)
    f = make_features(m, 4, seed=0)
    f = select_rows(f, [0, 1, 2, 3])
    name = next(k for k in f if "multi_hot" in k and not k.endswith("_lengths"))
    f[name] = f[name][:1]
    f[name + "_lengths"] = torch.tensor([1, 0, 0, 0])
    with pytest.raises(CaptureError, match="at least 2"):
        capture(m, (f,))


class _BranchesOnOneRow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, x):
        out = self.emb(x)
        return out * 2 if out.shape[0] == 1 else out


def test_size_oblivious_capture_keeps_the_graph_and_refuses_a_branch_on_one_row():
    import recforge.recom as recom
    from recforge.recom import CompileMismatchError

    m = small_model(multi_hot=0, large_multi_hot=0)
    f = make_features(m, 5, seed=0)
    fast, plain = capture(m, (f,)), capture(m, (f,), size_oblivious=False)
    assert str(fast.program.graph) == str(plain.program.graph)
    assert fast.program.range_constraints.keys() == plain.program.range_constraints.keys()
    one = make_features(m, 1, seed=2)
    torch.testing.assert_close(fast.program.module()(one), eager(m, one), rtol=0, atol=0)

    branchy, x = _BranchesOnOneRow().eval(), torch.tensor([1, 2, 3])
    with pytest.raises(Exception, match="Constraints violated"):  # the branch on batch == 1 is seen
        capture(branchy, (x,))
    with pytest.warns(UserWarning), pytest.raises(CompileMismatchError, match="batch of 1 rows"):
        recom.compile(branchy, (x,), backend="export", size_oblivious=False)  # the one-row check sees it
