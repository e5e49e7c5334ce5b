"""Shared builders for the column-compiler tests (no tests here): a small model with every column kind,
and a helper to run the whole column compiler on a captured module."""
from __future__ import annotations

import warnings

import torch

from recforge.recom.backend.column_compiler import compile_columns
from recforge.recom.family import FamilySpec, build_model, make_features
from recforge.recom.frontend.capture import capture

SMALL = FamilySpec(bucketized=3, int_hash=2, string_hash=2, multi_hot=6, large_multi_hot=1, raw_id=2,
                   large_rows=300, num_dense=4, bottom=(8,), top=(16,), dims=(4, 8, 12, 32), seed=3)


def small_model(**overrides):
    spec = SMALL if not overrides else FamilySpec(**{**SMALL.__dict__, **overrides})
    return build_model(spec)


def compiled_columns(module, features):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_columns(capture(module, (features,)))


def eager(module, *inputs):
    with torch.no_grad():
        return module(*inputs)


__all__ = ["SMALL", "compiled_columns", "eager", "make_features", "small_model"]
