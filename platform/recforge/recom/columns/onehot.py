"""Prove, from the preprocessing plan, that every sparse feature yields exactly one id per row.

RECom turns a pooled lookup into a plain gather when it can prove ``nnz == batch`` for a column
(paper §5.2). Here the proof is read from the RAP plan: a sparse feature has exactly one id per
row when its op chain fills nulls (at least one value) and keeps the first id (``firstx(1)``, at
most one), with only length-preserving ops after ``firstx``. With ``scalar_sources`` (the preprocessing reads
one value per column and row, as PreprocessModule's [B, F] matrices do) a chain of fill_null and length-preserving
ops without firstx is one id per row as well (RAP's plans 2 and 3 hash or clamp without firstx). Anything else is
refused.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from recforge.recom.errors import NotOneHotError

# Ops that map each id to one id (or one value to one value): they cannot change how many ids a row holds.
LENGTH_PRESERVING_OPS = frozenset(
    {"fill_null", "sigrid_hash", "bucketize", "clamp", "clip", "mod", "cast", "identity", "abs", "logit", "log1p",
     "boxcox"}
)
_FIRSTX_PARAM_NAMES = ("X", "x", "k", "n", "max_len", "max_length", "length")


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _features(plan: Any) -> list[Any]:
    feats = _field(plan, "features")
    if feats is None:
        raise NotOneHotError(
            f"cannot read the sparse features of plan {type(plan).__name__}: it has no `features` list"
        )
    return list(feats)


def _firstx_count(params: Any, feature: str) -> int:
    if isinstance(params, int) and not isinstance(params, bool):
        return params
    if isinstance(params, BaseModel):  # typed op params (Plan.typed_ops), else the plan's params mapping
        params = params.model_dump()
    elif params is not None and not isinstance(params, Mapping):
        raise NotOneHotError(f"feature {feature!r}: firstx params {params!r} are neither a mapping nor typed params")
    params = dict(params or {})
    for key in _FIRSTX_PARAM_NAMES:
        if key in params:
            return int(params[key])
    ints = [v for v in params.values() if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) == 1:
        return ints[0]
    raise NotOneHotError(f"feature {feature!r}: cannot read how many ids firstx keeps from its params {params!r}")


def prove_one_hot(plan: Any, feature_names: Sequence[str], scalar_sources: bool = False) -> dict[str, str]:
    """Return ``{feature: proof}`` for every name in ``feature_names``; raise NotOneHotError otherwise."""
    by_name = {}
    for feat in _features(plan):
        if _field(feat, "kind") == "sparse":
            by_name[_field(feat, "name")] = feat
    proofs: dict[str, str] = {}
    for name in feature_names:
        if name not in by_name:
            raise NotOneHotError(
                f"feature {name!r}: not a sparse feature of the preprocessing plan "
                f"(plan sparse features: {sorted(by_name)})"
            )
        ops = [(_field(o, "op"), _field(o, "params")) for o in (_field(by_name[name], "ops") or [])]
        names = [op for op, _ in ops]
        if scalar_sources and "firstx" not in names and names[:1] == ["fill_null"] and all(
                op in LENGTH_PRESERVING_OPS for op in names):
            proofs[name] = "scalar source column -> fill_null -> length-preserving ops: exactly one id per row"
            continue
        if "firstx" not in names:
            raise NotOneHotError(
                f"feature {name!r}: its plan has no firstx op (ops: {names}), so a row may hold many ids; "
                "the gather form needs firstx(1)"
            )
        last = len(names) - 1 - names[::-1].index("firstx")
        k = _firstx_count(ops[last][1], name)
        if k != 1:
            raise NotOneHotError(
                f"feature {name!r}: firstx({k}) keeps up to {k} ids per row; the gather form needs exactly one "
                "id per row (firstx(1)); keep the pooled EmbeddingBag path for this model"
            )
        after = [op for op in names[last + 1:] if op not in LENGTH_PRESERVING_OPS]
        if after:
            raise NotOneHotError(
                f"feature {name!r}: ops {after} after firstx(1) may change the number of ids per row"
            )
        if "fill_null" not in names[:last]:
            raise NotOneHotError(
                f"feature {name!r}: no fill_null before firstx(1), so a row with a null would hold no id"
            )
        proofs[name] = f"fill_null -> ... -> firstx(1) at op {last}: exactly one id per row"
    return proofs
