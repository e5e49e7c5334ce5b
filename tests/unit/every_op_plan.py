"""A small dataset and a plan with every fused op (scalar and fixed-width rows: onehot, ngram, firstx; not chainable,
so the fused executor runs its groups), and an output comparison, shared by the executor tests."""
from __future__ import annotations

import torch

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.preprocess.planning.plan import Plan

DS = DatasetConfig(
    name="every_op_small",
    dense=[DenseFeature(name=f"I{i}") for i in (1, 2, 3)],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c) for i, c in zip((1, 2, 3), (50, 7, 100_000), strict=True)],
)


def f(name, kind, source, *ops, **extra):
    """A plan feature: `ops` as (op, params) pairs; `extra` more of the feature's fields."""
    return {"name": name, "kind": kind, "source": source, "ops": [{"op": o, "params": p} for o, p in ops], **extra}


EVERY_OP = Plan.model_validate({"name": "every_op", "features": [
    f("I1", "dense", "I1", ("fill_null", {"value": 0.5}), ("logit", {"eps": 1e-3})),
    f("I2", "dense", "I2", ("fill_null", {}), ("boxcox", {"lambda": 0.25}), ("clamp", {"lo": -2, "hi": 30}),
      ("boxcox", {"lambda": 0.0})),
    f("I3", "dense", "I3", ("fill_null", {}), ("onehot", {"lo": -4, "hi": 60, "C": 6}), ("ngram", {"n": 3}),
      ("firstx", {"X": 1})),
    f("I3l", "dense", "I3", ("fill_null", {"value": -2}), ("clamp", {"lo": -5, "hi": 1e4}), ("log1p", {})),
    f("C1", "sparse", "C1", ("fill_null", {"value": 3}), ("sigrid_hash", {"salt": 11, "M": 50}),
      ("ngram", {"n": 2}), ("firstx", {"X": 3})),
    f("C2", "sparse", "C2", ("fill_null", {}), ("mapid", {"map": [16, 15, 14, 2**40]}), ("clamp", {"lo": 0, "hi": 9})),
    f("C2h", "sparse", "C2", ("fill_null", {}), ("sigrid_hash", {"M": 7}), ("cast", {"to": "float"}),
      ("bucketize", {"borders": [0.5, 2.5, 4.0]})),
    f("I1c", "sparse", "I1", ("fill_null", {}), ("cast", {"to": "id"}), ("clamp", {"lo": 0, "hi": 20})),
    f("C3", "sparse", "C3", ("fill_null", {}), ("sigrid_hash", {"M": 100_000}), ("firstx", {"X": 1})),
]})


def outputs_equal(a, b) -> None:
    assert torch.equal(torch.isnan(a[0]), torch.isnan(b[0]))
    assert torch.equal(torch.nan_to_num(a[0]), torch.nan_to_num(b[0]))
    assert a[1].keys() == b[1].keys()
    assert torch.equal(a[1].values(), b[1].values()) and torch.equal(a[1].lengths(), b[1].lengths())
