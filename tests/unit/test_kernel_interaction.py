"""recforge_kernels.interaction: the C++ dot interaction against torchrec's InteractionArch (values, gradients, pair
order), its shapes and dtypes, bad input, the torch fallback, and graph capture (fx, torch.export) taking the torch
path."""
from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from recforge_kernels import interaction as inter

pytestmark = pytest.mark.skipif(inter.extension() is None, reason=f"C++ kernel not built: {inter.status()}")


def _inputs(b: int, f: int, d: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(b, d, generator=g, dtype=dtype, requires_grad=True)
    sparse = torch.randn(b, f, d, generator=g, dtype=dtype, requires_grad=True)
    return dense, sparse


@pytest.mark.parametrize("b,f,d", [(512, 26, 16), (13, 3, 5), (1, 1, 16), (9, 7, 16), (8, 30, 3)])
def test_kernel_equals_torchrec_interaction_forward_and_backward(b, f, d):
    dense, sparse = _inputs(b, f, d)
    assert inter.uses_kernel(dense, sparse)
    want = InteractionArch(f)(dense, sparse)
    got = inter.dot_interaction(dense, sparse)
    assert got.shape == want.shape == (b, d + (f + 1) * f // 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(want)
    want_g = torch.autograd.grad(want, (dense, sparse), grad)
    got_g = torch.autograd.grad(got, (dense, sparse), grad)
    for w, g in zip(want_g, got_g, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_pair_order_is_torchrec_triu_order():
    """Vectors with one 1 each: pair (i, j) is 1 only where both are the same unit vector, so each output column
    names its pair."""
    d = 4
    dense = torch.eye(d)[:1].clone()  # v0 = e0
    sparse = torch.eye(d)[[0, 1, 1]].unsqueeze(0)  # v1 = e0, v2 = e1, v3 = e1
    out = inter.dot_interaction(dense, sparse)[0, d:]
    # pairs (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
    assert out.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_float64_gradcheck():
    dense, sparse = _inputs(3, 4, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(inter.dot_interaction, (dense, sparse))


def test_non_contiguous_inputs():
    dense, sparse = _inputs(10, 5, 6)
    dense_t = dense.detach().t().contiguous().t()  # [B, D] view with strides (1, B)
    sparse_t = sparse.detach().transpose(0, 1).contiguous().transpose(0, 1)
    assert not dense_t.is_contiguous() and not sparse_t.is_contiguous()
    torch.testing.assert_close(inter.dot_interaction(dense_t, sparse_t), InteractionArch(5)(dense_t, sparse_t))


def test_no_sparse_features_gives_the_dense_vector():
    dense = torch.randn(6, 4)
    out = inter.dot_interaction(dense, torch.empty(6, 0, 4))
    assert torch.equal(out, dense)


@pytest.mark.parametrize("dense,sparse,match", [
    (torch.randn(4, 8), torch.randn(4, 3, 7), r"\(4, 8\) and \(4, 3, 7\)"),
    (torch.randn(4, 8), torch.randn(5, 3, 8), r"\(4, 8\) and \(5, 3, 8\)"),
    (torch.randn(4, 8, 1), torch.randn(4, 3, 8), r"dense must be \[B, D\]"),
])
def test_bad_input_is_refused_naming_it(dense, sparse, match):
    with pytest.raises(ValueError, match=match):
        inter.dot_interaction(dense, sparse)


def test_kernel_refuses_a_wrong_gradient_shape():
    dense, sparse = _inputs(4, 3, 8)
    with pytest.raises(RuntimeError, match="grad must be"):
        inter.extension().backward(torch.randn(4, 5), dense.detach(), sparse.detach())


def test_fallback_without_the_extension_gives_the_same_values(monkeypatch):
    dense, sparse = _inputs(20, 6, 8)
    fast = inter.dot_interaction(dense, sparse)
    monkeypatch.setitem(inter.LIBRARY._state, "ops", None)
    assert not inter.uses_kernel(dense, sparse)
    slow = inter.dot_interaction(dense, sparse)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
    slow.sum().backward()  # the torch path is differentiable too
    assert dense.grad is not None and sparse.grad is not None


def test_mixed_dtypes_are_promoted_as_torchrec_does():
    dense, sparse = (t.detach() for t in _inputs(4, 3, 8))
    sparse64 = sparse.double()
    assert not inter.uses_kernel(dense, sparse64)
    out = inter.dot_interaction(dense, sparse64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, InteractionArch(3)(dense, sparse64))


def test_double_backward_is_refused_not_wrong():
    dense, sparse = _inputs(4, 3, 8)
    out = inter.dot_interaction(dense, sparse)
    (g,) = torch.autograd.grad(out.square().sum(), dense, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiable"):
        g.sum().backward()


def test_low_precision_takes_the_torch_path():
    dense, sparse = (t.detach().to(torch.bfloat16) for t in _inputs(4, 3, 8))
    assert not inter.uses_kernel(dense, sparse)
    assert inter.dot_interaction(dense, sparse).dtype == torch.bfloat16


class _Wrap(torch.nn.Module):
    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return inter.dot_interaction(dense, sparse) * 2


def test_fx_symbolic_trace_records_the_torch_path():
    graph = torch.fx.symbolic_trace(_Wrap())
    targets = {str(n.target) for n in graph.graph.nodes}
    assert "index_select" in targets and not any("DotInteraction" in t for t in targets)
    dense, sparse = (t.detach() for t in _inputs(5, 4, 8))
    torch.testing.assert_close(graph(dense, sparse), _Wrap()(dense, sparse), rtol=1e-5, atol=1e-5)


def test_torch_export_captures_the_torch_path():
    dense, sparse = (t.detach() for t in _inputs(5, 4, 8))
    ep = torch.export.export(_Wrap(), (dense, sparse))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("index_select" in o for o in ops)
    torch.testing.assert_close(ep.module()(dense, sparse), _Wrap()(dense, sparse), rtol=1e-5, atol=1e-5)
