"""The Triton (CUDA) ``embedding_layer`` kernel against the plain-torch reference, on this CPU, under the Triton
interpreter (TRITON_INTERPRET=1).

TRITON_INTERPRET is read when triton is imported, so the checks run in a child python (this file run as a script)
and no other test's process ever imports triton in interpreter mode. Skipped where triton is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CASES = ("random layers", "row tiles", "long bags", "sigrid extremes", "value dtypes", "bucketize edges",
         "strided inputs", "empty bags", "one value per row pooled", "out of range ids", "unchecked ids",
         "empty batch and no columns")


NO_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
INTERPRET_TIMEOUT_S, COMPILE_TIMEOUT_S = 300, 180


@pytest.fixture(scope="module")
def compile_child(tmp_path_factory):
    """The sm90 compile child, started before the interpreter test runs (both are single-threaded children: on two
    cores they run side by side) and collected by the compile test."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # a cold compile every run (about 10 s; over 10 min when it regressed)
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    child = subprocess.Popen([sys.executable, __file__, "compile"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    yield child
    if child.poll() is None:
        child.kill()
        child.communicate()


@NO_TRITON
def test_triton_embedding_kernel_matches_reference_under_the_interpreter(compile_child):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=INTERPRET_TIMEOUT_S)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-6000:]
    assert [ln[3:] for ln in res.stdout.splitlines() if ln.startswith("ok ")] == list(CASES), res.stdout


@NO_TRITON
def test_triton_embedding_kernel_compiles_for_sm90_without_a_gpu(compile_child):
    """Triton's front end, GPU passes and bundled ptxas need no driver: a kernel that the interpreter runs but the
    compiler rejects (or takes minutes on, as an unrolled 32-bag loop did) fails here."""
    try:
        stdout, stderr = compile_child.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        compile_child.kill()
        stdout, stderr = compile_child.communicate()
        pytest.fail(f"the sm90 compile ran over {COMPILE_TIMEOUT_S} s\n{stdout[-4000:]}{stderr[-6000:]}")
    assert compile_child.returncode == 0, stdout[-4000:] + stderr[-6000:]
    assert "cubin bytes" in stdout, stdout


# ---- the children: everything below runs only under `python this_file.py [compile]` ----

def _compile_for_sm90() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from recforge_kernels import embedding_layout as L
    from recforge_kernels import embedding_triton as T

    sig = {"meta_ptr": "*i64", "table_ptr": "*i64", "offs_ptr": "*i64", "weights_ptr": "*fp32", "fbuf_ptr": "*fp64",
           "ibuf_ptr": "*i64", "out_ptr": "*fp32", "err_ptr": "*i64", "batch": "i32", "total_dim": "i32",
           "tiles_per_col": "i32"}
    const = dict(META_WIDTH=L.META_WIDTH, STEP_BASE=L.STEP_BASE, STEP_WIDTH=L.STEP_WIDTH, MAX_STEPS=L.MAX_STEPS,
                 SEARCH_STEPS=5, TILE=T.TILE_ROWS, DBLOCK=32, KBLOCK=T.K_BLOCK, NSTEPS_AT=L.F["nsteps"])
    sig.update({k: "constexpr" for k in const})
    kernel = triton.compile(ASTSource(T._embedding_layer_kernel, sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32))
    print("cubin bytes", len(kernel.asm["cubin"]))
    return 0


def _main() -> int:
    import random
    import warnings

    import numpy as np
    import torch

    from recforge_kernels import embedding_layout as L
    from recforge_kernels.embedding_reference import embedding_layer_reference
    from recforge_kernels.embedding_triton import embedding_layer_cuda
    from test_recom_kernel import Layer, _one_column  # the CPU op's random column programs, same file dir

    assert os.environ.get("TRITON_INTERPRET") == "1"
    # float NaN -> int64 casts of values that a bucketize then reads as floats: harmless numpy noise
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    np.seterr(all="ignore")
    I64_MIN, I64_MAX = L.INT64_MIN, L.INT64_MAX

    def same(args, what):
        want = embedding_layer_reference(*args)
        got = embedding_layer_cuda(*args)
        assert got.shape == want.shape and got.dtype == torch.float32, (what, got.shape, want.shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")

    def with_head(args, **fields):
        inputs, w, fb, ib, meta, b, d = args
        meta = meta.clone()
        for k, v in fields.items():
            meta[0, L.F[k]] = v
        return inputs, w, fb, ib, meta, b, d

    def random_layers():
        for seed in range(10):
            rng = random.Random(100 + seed)
            layer = Layer(rng, batch=rng.choice((1, 17, 64)), ncols=rng.randint(1, 8))
            same(layer.args(), f"seed {seed}")

    def row_tiles():  # 32-row tiles: three programs per column, the last one partial
        same(Layer(random.Random(7), batch=70, ncols=6).args(), "batch 70")

    def long_bags():  # bags longer than the kernel's 16-id block, and mean pooling over them
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(0, 40, (9,), generator=g)
        lengths[3] = 0
        values = torch.randint(-(1 << 50), 1 << 50, (int(lengths.sum()),), generator=g)
        for lookup in (L.LOOKUP_SUM, L.LOOKUP_MEAN):
            same(_one_column(values, lengths, steps=[[L.OP_MOD, 10, 0, 0, 0, 0]], lookup=lookup), f"lookup {lookup}")

    def sigrid_extremes():
        x = torch.tensor([0, 1, -1, I64_MAX, I64_MIN, (1 << 32) - 1, -(1 << 40), 12345678901])
        for salt in (0, 5, -3, I64_MAX, I64_MIN):
            for rows in (1, 7, 10):
                same(_one_column(x, steps=[[L.OP_SIGRID, salt, rows, 0, 0, 0]], rows=rows), f"salt {salt} M {rows}")
        same(_one_column(x, torch.tensor([3, 0, 5]), steps=[[L.OP_SIGRID, 99, 10, 0, 0, 0]], lookup=L.LOOKUP_MEAN),
             "jagged")

    def value_dtypes():
        base = torch.tensor([0, 1, 5, 9, 100, -3, 127, 64])
        for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            same(_one_column(base.to(dt), steps=[[L.OP_MOD, 10, 0, 0, 0, 0]]), f"{dt}")
        same(_one_column(base > 4), "bool")
        same(_one_column(base.to(torch.int32), torch.tensor([2, 0, 4, 2], dtype=torch.int32),
                         steps=[[L.OP_MOD, 10, 0, 0, 0, 0]], lookup=L.LOOKUP_SUM), "int32 values and lengths")

    def bucketize_edges():
        x = torch.tensor([float("nan"), float("inf"), float("-inf"), -1.0, 0.0, -0.0, 0.5, 2.0, 2.5, 1e30])
        fb = torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
        ib = torch.tensor([-5, 0, 3, 3, 8])
        for right in (0, 1):
            for dt in (torch.float32, torch.float64):
                inputs, w, _, _, meta, b, d = _one_column(x.to(dt), steps=[[L.OP_BUCKETIZE, 0, 4, right, 1, 0]])
                same((inputs, w, fb, ib, meta, b, d), f"float {dt} right={right}")
            ints = torch.tensor([-6, -5, -4, 0, 2, 3, 4, 8, 9, I64_MAX])
            inputs, w, _, _, meta, b, d = _one_column(ints, steps=[[L.OP_BUCKETIZE, 0, 5, right, 0, 0]])
            same((inputs, w, fb, ib, meta, b, d), f"int boundaries right={right}")
            inputs, w, _, _, meta, b, d = _one_column(ints, steps=[[L.OP_BUCKETIZE, 1, 3, right, 1, 0]])
            same((inputs, w, fb, ib, meta, b, d), f"int values, float boundaries right={right}")

    def strided_inputs():  # a column of a transposed (non-contiguous) 2-D tensor, its flag from another one
        g = torch.Generator().manual_seed(2)
        grid = torch.randint(-20, 20, (3, 11), generator=g).t()
        flags = (torch.rand(4, 11, generator=g) < 0.6).t()
        for c in range(3):
            args = with_head(_one_column(grid, steps=[[L.OP_SELECT, 1, c, 1, 1, -2], [L.OP_MOD, 10, 0, 0, 0, 0]]),
                             in_col=c)
            inputs, w, fb, ib, meta, b, d = args
            same(([grid, flags], w, fb, ib, meta, b, d), f"column {c}")

    def empty_bags():
        values = torch.tensor([1, 2, 3, 4, 5, 6])
        lengths = torch.tensor([0, 2, 0, 3, 1, 0])
        remove_odd_bag = [L.OP_REMOVE, 5, 5, 1, 0, 0]  # drops everything but 5: bags 1 and 4 end up empty
        for lookup in (L.LOOKUP_SUM, L.LOOKUP_MEAN):
            for empty_id in (-1, 0, 9, 10):  # 10 is outside the table: zeros, as the reference
                for steps in ([], [remove_odd_bag]):
                    args = with_head(_one_column(values, lengths, steps=steps, lookup=lookup), empty_id=empty_id)
                    same(args, f"lookup {lookup} empty_id {empty_id} steps {steps}")
        args = _one_column(torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                           lookup=L.LOOKUP_MEAN)
        assert torch.equal(embedding_layer_cuda(*args), torch.zeros(4, 4)), "an all-empty mean bag is 0"

    def one_value_per_row_pooled():  # removed value -> empty bag -> empty_id's row (or zeros)
        x = torch.tensor([1, 7, 3, 8, 2])
        for lookup in (L.LOOKUP_GATHER, L.LOOKUP_SUM, L.LOOKUP_MEAN):
            for empty_id in (-1, 4, 10):
                args = with_head(_one_column(x, steps=[[L.OP_REMOVE, 0, 5, 0, 0, 0]], lookup=lookup), empty_id=empty_id)
                same(args, f"lookup {lookup} empty_id {empty_id}")

    def out_of_range_ids():
        bad = [(_one_column(torch.tensor([1, 10, 2])), 0),
               (_one_column(torch.tensor([-1, 0])), 0),
               (_one_column(torch.tensor([3, 11]), torch.tensor([1, 1]), lookup=L.LOOKUP_SUM), 0),
               (_one_column(torch.tensor([3, 4, 99]), torch.tensor([0, 3]), lookup=L.LOOKUP_MEAN), 0)]
        inputs, w, fb, ib, meta, b, d = _one_column(torch.tensor([1, 2, 3]))
        second = meta.clone()  # a second column reading the same values, 12 -> out of its 10 rows
        second[0, L.STEP_BASE: L.STEP_BASE + 6] = torch.tensor([L.OP_ADD, 9, 0, 0, 0, 0])
        second[0, L.F["nsteps"]] = 1
        bad.append(((inputs, w, fb, ib, torch.cat([meta, second]), b, d), 1))
        for args, col in bad:
            for run in (embedding_layer_reference, embedding_layer_cuda):
                try:
                    run(*args)
                except IndexError as e:
                    assert f"column {col} looked up" in str(e), (run.__name__, e)
                else:
                    raise AssertionError(f"{run.__name__}: no IndexError for column {col}")
        # a REMOVE before the lookup drops the out-of-range id: no error
        same(_one_column(torch.tensor([1, 10, 2]), steps=[[L.OP_REMOVE, 0, 9, 0, 0, 0]]), "removed first")

    def unchecked_ids():  # check=0 (the compiler proved the range); a wrong proof reads nothing: zero rows
        inputs, w, fb, ib, meta, b, d = _one_column(torch.tensor([1, 10, -4, 2]), check=0)
        got = embedding_layer_cuda(inputs, w, fb, ib, meta, b, d)
        table = w.view(10, 4)
        assert torch.equal(got, torch.stack([table[1], torch.zeros(4), torch.zeros(4), table[2]]))

    def empty_batch_and_no_columns():
        args = _one_column(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), lookup=L.LOOKUP_SUM,
                           batch=0)
        assert embedding_layer_cuda(*args).shape == (0, 4)
        inputs, w, fb, ib, meta, b, _ = _one_column(torch.tensor([1, 2]))
        assert embedding_layer_cuda(inputs, w, fb, ib, meta[:0], b, 0).shape == (2, 0)

    checks = [random_layers, row_tiles, long_bags, sigrid_extremes, value_dtypes, bucketize_edges, strided_inputs,
              empty_bags, one_value_per_row_pooled, out_of_range_ids, unchecked_ids, empty_batch_and_no_columns]
    failed = 0
    for name, check in zip(CASES, checks, strict=True):
        try:
            check()
            print("ok", name, flush=True)
        except Exception as e:  # noqa: BLE001  (report every failing case, not only the first)
            failed += 1
            print("FAIL", name, repr(e)[:2000], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_compile_for_sm90() if sys.argv[1:] == ["compile"] else _main())
