"""recforge::embedding_layer (C++/OpenMP) against the plain-torch reference on random column programs.

The first call builds the C++ extension (about a minute on 2 cold cores; cached afterwards).
"""
from __future__ import annotations

import random

import pytest
import torch

from recforge_kernels import embedding_layout as L
from recforge_kernels.embedding_op import embedding_layer, workspace_elements
from recforge_kernels.embedding_reference import embedding_layer_reference

DIMS = (1, 3, 4, 8, 12, 16, 32, 33, 64)


class Layer:
    """A random fused layer: inputs, packed weights/boundaries and metadata rows."""

    def __init__(self, rng: random.Random, batch: int, ncols: int):
        self.batch, self.inputs, self.rows, self.fb, self.ib = batch, [], [], [], []
        self.weights: list[torch.Tensor] = []
        self.w_off = 0
        self.out_off = 0
        grid = torch.randint(-50, 50, (batch, 3))
        flags = torch.rand(batch, 3) < 0.7
        self.grid_at, self.flags_at = self.add(grid), self.add(flags)
        for _ in range(ncols):
            self.column(rng)

    def add(self, t: torch.Tensor) -> int:
        self.inputs.append(t)
        return len(self.inputs) - 1

    def column(self, rng: random.Random) -> None:
        B = self.batch
        rows, dim = rng.choice((1, 2, 7, 50, 300)), rng.choice(DIMS)
        kind = rng.choice(("float", "int", "grid", "jagged", "jagged32"))
        lengths_at, col, steps = -1, -1, []
        if kind == "float":
            x = torch.randn(B) * 3
            x[torch.rand(B) < 0.1] = float("nan")
            value_at = self.add(x)
            bnd = sorted(rng.uniform(-4, 4) for _ in range(rng.randint(1, 20)))
            steps.append([L.OP_BUCKETIZE, len(self.fb), len(bnd), rng.randint(0, 1), 1, 0])
            self.fb += bnd
        elif kind == "grid":
            value_at, col = self.grid_at, rng.randint(0, 2)
            steps.append([L.OP_SELECT, self.flags_at, rng.randint(0, 2), 1, 1, rng.randint(-3, 3)])
        elif kind == "int":
            value_at = self.add(torch.randint(-1000, 1000, (B,)))
        else:
            lengths = torch.randint(0, 5, (B,))
            lengths[torch.rand(B) < 0.3] = 0
            value_at = self.add(torch.randint(-(1 << 40), 1 << 40, (int(lengths.sum()),)))
            lengths_at = self.add(lengths.to(torch.int32) if kind == "jagged32" else lengths)
        for _ in range(rng.randint(0, L.MAX_STEPS - 2 - len(steps))):
            op = rng.choice((L.OP_ADD, L.OP_REPLACE, L.OP_REMOVE, L.OP_CLAMP, L.OP_BUCKETIZE, L.OP_MOD))
            lo = rng.randint(-20, 20)
            if op == L.OP_ADD:
                steps.append([op, rng.randint(-5, 5), 0, 0, 0, 0])
            elif op == L.OP_REPLACE:
                steps.append([op, lo, lo + rng.randint(0, 40), rng.randint(0, 1), rng.randint(-2, 2), 0])
            elif op == L.OP_REMOVE:
                steps.append([op, lo, lo + rng.randint(0, 40), rng.randint(0, 1), 0, 0])
            elif op == L.OP_CLAMP:
                steps.append([op, rng.randint(-30, 0), rng.randint(0, 30), 0, 0, 0])
            elif op == L.OP_BUCKETIZE:
                bnd = sorted(rng.sample(range(-100, 100), rng.randint(1, 9)))
                steps.append([op, len(self.ib), len(bnd), rng.randint(0, 1), 0, 0])
                self.ib += bnd
            else:
                steps.append([op, rng.randint(1, 9), 0, 0, 0, 0])
        last = rng.choice((L.OP_MOD, L.OP_SIGRID, L.OP_CLAMP))  # ends inside the table
        steps.append([L.OP_MOD, rows, 0, 0, 0, 0] if last == L.OP_MOD else
                     [L.OP_SIGRID, rng.randint(0, 1 << 40), rows, 0, 0, 0] if last == L.OP_SIGRID else
                     [L.OP_CLAMP, 0, rows - 1, 0, 0, 0])
        if rng.random() < 0.3:
            steps.append([L.OP_REMOVE, 0, rows // 2, 0, 0, 0])
        assert len(steps) <= L.MAX_STEPS
        jagged = lengths_at >= 0
        lookup = rng.choice((L.LOOKUP_SUM, L.LOOKUP_MEAN)) if jagged else rng.choice(
            (L.LOOKUP_GATHER, L.LOOKUP_SUM, L.LOOKUP_MEAN))
        w = torch.randn(rows, dim)
        self.weights.append(w)
        head = {"in_value": value_at, "in_col": col, "in_lengths": lengths_at, "lookup": lookup,
                "empty_id": rng.choice((-1, -1, rows - 1)), "rows": rows, "dim": dim, "w_off": self.w_off,
                "out_off": self.out_off, "check": rng.randint(0, 1), "nsteps": len(steps),
                "ws_b": 2 if jagged else 1, "ws_n": 1 if jagged else 0, "ws_c": 1}
        self.w_off += rows * dim + rng.choice((0, 5))
        self.out_off += dim
        row = [head[k] for k in L.META_FIELDS] + [v for s in steps for v in s]
        self.rows.append(row + [0] * (L.META_WIDTH - len(row)))

    def args(self):
        weights = torch.zeros(self.w_off)
        for r, w in zip(self.rows, self.weights, strict=True):
            off = r[L.F["w_off"]]
            weights[off: off + w.numel()] = w.reshape(-1)
        return (self.inputs, weights, torch.tensor(self.fb or [0.0], dtype=torch.float64),
                torch.tensor(self.ib or [0], dtype=torch.int64), torch.tensor(self.rows, dtype=torch.int64),
                self.batch, self.out_off)


@pytest.mark.parametrize("seed", range(12))
def test_kernel_matches_reference(seed):
    rng = random.Random(seed)
    layer = Layer(rng, batch=rng.choice((1, 2, 17, 64)), ncols=rng.randint(1, 12))
    args = layer.args()
    want = embedding_layer_reference(*args)
    got = embedding_layer(*args)
    assert got.shape == want.shape == (layer.batch, layer.out_off) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_threads_do_not_change_the_result():
    layer = Layer(random.Random(99), batch=200, ncols=30)
    args = layer.args()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = embedding_layer(*args)
        torch.set_num_threads(2)
        two = embedding_layer(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _one_column(values, lengths=None, steps=(), rows=10, check=1, lookup=L.LOOKUP_GATHER, batch=None):
    inputs = [values] + ([lengths] if lengths is not None else [])
    batch = batch if batch is not None else (lengths.shape[0] if lengths is not None else values.shape[0])
    head = {"in_value": 0, "in_col": -1, "in_lengths": 1 if lengths is not None else -1, "lookup": lookup,
            "empty_id": -1, "rows": rows, "dim": 4, "w_off": 0, "out_off": 0, "check": check,
            "nsteps": len(steps), "ws_b": 2, "ws_n": 1, "ws_c": 1}
    row = [head[k] for k in L.META_FIELDS] + [v for s in steps for v in s]
    meta = torch.tensor([row + [0] * (L.META_WIDTH - len(row))], dtype=torch.int64)
    return inputs, torch.randn(rows * 4), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.int64), \
        meta, batch, 4


def test_out_of_range_ids_raise_index_error_like_eager():
    args = _one_column(torch.tensor([1, 10, 2]))
    with pytest.raises(IndexError, match="column 0 looked up id 10 outside its table of 10 rows"):
        embedding_layer(*args)
    with pytest.raises(IndexError):
        torch.nn.functional.embedding(torch.tensor([1, 10, 2]), torch.randn(10, 4))  # eager does the same
    with pytest.raises(IndexError):
        embedding_layer(*_one_column(torch.tensor([-1, 0])))
    with pytest.raises(IndexError):
        embedding_layer(*_one_column(torch.tensor([3, 11]), torch.tensor([1, 1]), lookup=L.LOOKUP_SUM))


def test_bad_lengths_are_value_errors():
    with pytest.raises(ValueError, match="negative length"):
        embedding_layer(*_one_column(torch.tensor([1, 2]), torch.tensor([3, -1]), lookup=L.LOOKUP_SUM))
    with pytest.raises(ValueError, match="lengths sum to 3 but it has 2 values"):
        embedding_layer(*_one_column(torch.tensor([1, 2]), torch.tensor([1, 2]), lookup=L.LOOKUP_SUM))


def test_shape_and_metadata_errors():
    with pytest.raises(RuntimeError, match="batch has 5"):
        embedding_layer(*_one_column(torch.tensor([1, 2]), batch=5))
    inputs, w, fb, ib, meta, b, d = _one_column(torch.tensor([1, 2]))
    bad = meta.clone()
    bad[0, L.F["out_off"]] = 3
    with pytest.raises(RuntimeError, match="outside the output row"):
        embedding_layer(inputs, w, fb, ib, bad, b, d)
    bad = meta.clone()
    bad[0, L.F["w_off"]] = 1
    with pytest.raises(RuntimeError, match="outside the packed weights"):
        embedding_layer(inputs, w, fb, ib, bad, b, d)
    bad = meta.clone()
    bad[0, L.F["ws_b"]], bad[0, L.F["ws_n"]], bad[0, L.F["ws_c"]] = 0, 0, 1
    with pytest.raises(RuntimeError, match="workspace bound"):
        embedding_layer(inputs, w, fb, ib, bad, b, d)
    with pytest.raises(ValueError, match="meta must be"):
        embedding_layer(inputs, w, fb, ib, meta[:, :5], b, d)


def test_empty_batch_and_workspace_size():
    inputs, w, fb, ib, meta, _, d = _one_column(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                                lookup=L.LOOKUP_SUM)
    assert embedding_layer(inputs, w, fb, ib, meta, 0, d).shape == (0, 4)
    lengths = torch.tensor([2, 0, 1])
    inputs, w, fb, ib, meta, b, d = _one_column(torch.tensor([1, 2, 3]), lengths, lookup=L.LOOKUP_SUM)
    assert workspace_elements(inputs, meta, b) == 2 * 3 + 1 * 3 + 1


def test_op_exports_with_a_dynamic_batch():
    class Uses(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            _, w, fb, ib, meta, _, d = args
            self.register_buffer("w", w)
            self.register_buffer("fb", fb)
            self.register_buffer("ib", ib)
            self.register_buffer("rows", meta)
            self.d = d

        def forward(self, x):
            return torch.ops.recforge.embedding_layer([x], self.w, self.fb, self.ib, self.rows, x.shape[0], self.d)

    args = _one_column(torch.tensor([1, 2, 3]), steps=[[L.OP_MOD, 10, 0, 0, 0, 0]], check=0)
    mod = Uses(args)
    ep = torch.export.export(mod, (torch.tensor([1, 2, 3]),), dynamic_shapes=({0: torch.export.Dim("b")},))
    x = torch.tensor([5, -7, 12, 0, 9])
    torch.testing.assert_close(ep.module()(x), mod(x))
    assert any("embedding_layer" in str(n.target) for n in ep.graph.nodes)


def _triton_runnable() -> bool:
    import os

    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_runnable(), reason="needs triton and a GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("seed", range(4))
def test_triton_kernel_matches_reference(seed):
    from recforge_kernels.embedding_triton import embedding_layer_cuda

    rng = random.Random(100 + seed)
    layer = Layer(rng, batch=rng.choice((1, 17, 64)), ncols=rng.randint(1, 8))
    inputs, weights, fb, ib, meta, batch, width = layer.args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = embedding_layer_cuda([t.to(device) for t in inputs], weights.to(device), fb.to(device), ib.to(device),
                               meta.to(device), batch, width)
    torch.testing.assert_close(got.cpu(), embedding_layer_reference(inputs, weights, fb, ib, meta, batch, width),
                               rtol=1e-5, atol=1e-5)
