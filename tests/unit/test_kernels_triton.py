"""The Triton (CUDA) kernels, run on CPU under TRITON_INTERPRET=1 against the fused torch fallback. The check runs
in a subprocess because TRITON_INTERPRET is read when triton is imported. Skipped where triton is not installed
(the CPU venv has no triton; `PYTHONPATH=<dir with triton> pytest ...` runs it)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent('''
    import numpy as np, torch
    from recforge_kernels import fused_torch as ref, triton_fused as tri
    from recforge_kernels.reference import INT64_MAX, INT64_MIN
    g = torch.Generator().manual_seed(0)
    ints = [torch.randint(-2**62, 2**62, (n,), generator=g) for n in (0, 5, 1500, 37)]
    ints[2][:6] = torch.tensor([0, 1, -1, INT64_MAX, INT64_MIN, 2**32 - 1])
    floats = [torch.randn(n, generator=g) * 10 for n in (3, 1500, 0, 64)]
    floats[1][:7] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-5, 0.99999])
    def same(a, b, name):
        assert len(a) == len(b), name
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape, x.dtype, y.dtype)
            if x.is_floating_point():
                torch.testing.assert_close(x, y, rtol=1e-6, atol=0, equal_nan=True, msg=name)
            else:
                assert torch.equal(x, y), name
    n = len(ints)
    moduli = [1, 65536, 10131227, INT64_MAX]
    salts = [0, 5, -3, INT64_MAX]
    same(tri.sigrid_hash(ints, salts, moduli), ref.sigrid_hash(ints, salts, moduli), "sigrid_hash")
    same(tri.logit(floats, [1e-5] * 4, [0.99999] * 4), ref.logit(floats, [1e-5] * 4, [0.99999] * 4), "logit")
    same(tri.boxcox(floats, [0.0, 0.5, -1.0, 1e-5]), ref.boxcox(floats, [0.0, 0.5, -1.0, 1e-5]), "boxcox")
    tiny = [f * 1e-9 for f in floats] + [torch.tensor([1e-30, 3e-8, 0.75, 2.0**24, 3.4e38, -0.0])]
    same(tri.log1p(floats + tiny), ref.log1p(floats + tiny), "log1p")
    same(tri.clamp_float(floats, [-1.0] * 4, [2.0] * 4), ref.clamp_float(floats, [-1.0] * 4, [2.0] * 4), "clamp_float")
    same(tri.clamp_id(ints, [-5] * n, [2**40] * n), ref.clamp_id(ints, [-5] * n, [2**40] * n), "clamp_id")
    b = torch.tensor([-1.0, 0.0, 3.0, 0.5])
    same(tri.bucketize(floats, b, [0, 3, 3, 4, 4]), ref.bucketize(floats, b, [0, 3, 3, 4, 4]), "bucketize")
    small = [x % 7 - 2 for x in ints]
    t = torch.tensor([16, 15, 14, 2**40, 3, 9, -4, 2])
    same(tri.mapid(small, t, [0, 3, 5, 6, 8]), ref.mapid(small, t, [0, 3, 5, 6, 8]), "mapid")
    same(tri.cast(floats, False), ref.cast(floats, False), "cast_id")
    valids = [torch.rand(x.shape, generator=g) > 0.3 for x in ints]
    for dense in (True, False):
        fills = [2.0, -1.0, 0.0, 7.0]
        same(tri.fill_null(ints, valids, fills, dense), ref.fill_null(ints, valids, fills, dense), "fill_null")
    m = torch.randint(-9, 9, (300, 5), generator=g)
    mv = torch.rand(m.shape, generator=g) > 0.5
    same(tri.fill_null_columns(m, mv, [4, 0, 2], [1.0, 2.0, 3.0], True),
         ref.fill_null_columns(m, mv, [4, 0, 2], [1.0, 2.0, 3.0], True), "fill_null_columns")
    mf = torch.randn(300, 5, generator=g, dtype=torch.float64) * 1e3
    mf[:4, 0] = torch.tensor([float("nan"), float("inf"), 1e300, -0.0], dtype=torch.float64)
    same(tri.fill_null_columns(mf, mv, [4, 0, 2], [1.0, 2.0, 3.0], True),
         ref.fill_null_columns(mf, mv, [4, 0, 2], [1.0, 2.0, 3.0], True), "fill_null_columns float64")
    oh = [f.unsqueeze(1) for f in floats]
    lo, hi, sizes = [-5.0] * 4, [16.0] * 4, [5, 8, 1, 3]
    same(tri.onehot(oh, lo, hi, sizes), ref.onehot(oh, lo, hi, sizes), "onehot")
    same(tri.onehot(oh, lo, hi, sizes, [1, 3, 1, 9]), ref.onehot(oh, lo, hi, sizes, [1, 3, 1, 9]), "onehot keep")
    rows = [torch.randint(0, 99, (r, w), generator=g) for r, w in ((7, 8), (0, 3), (300, 1), (5, 2))]
    for k in (1, 2, 4, 9):
        same(tri.ngram(rows, [k] * 4), ref.ngram(rows, [k] * 4), f"ngram {k}")
        same(tri.firstx(rows, [k] * 4), ref.firstx(rows, [k] * 4), f"firstx {k}")
    print("triton kernels ok")
''')


def _has_triton() -> bool:
    return subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_kernels_match_torch_fallback_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "triton kernels ok" in res.stdout
