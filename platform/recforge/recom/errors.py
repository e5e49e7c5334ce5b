"""Errors raised by the compile stage; each message says what failed and what to change."""
from __future__ import annotations


class RecomError(Exception):
    """Base class of compile-stage errors."""


class NotOneHotError(RecomError, ValueError):
    """A lookup cannot be lowered to a plain gather: one id per row per feature is not proven."""


class UnsupportedModelError(RecomError, TypeError):
    """The model is not a single-device torchrec DLRM (or subclass) this stage knows how to lower."""


class CompileMismatchError(RecomError, AssertionError):
    """A compiled model's outputs differ from the eager reference by more than the tolerance."""


class LookupIndexError(IndexError, RuntimeError):
    """A compiled embedding layer met an id outside its table at run time. Eager raises IndexError for
    ``embedding`` and RuntimeError for ``embedding_bag``; this is both, so code written for eager catches it."""
