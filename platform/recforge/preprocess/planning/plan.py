"""Preprocessing plans: which ops turn which source column into which model feature (RAP's plan files, typed).

A Plan is JSON/YAML-loadable; construction checks everything that needs no dataset (known ops, their
parameters, a bounded id range for every sparse feature), and `validate_for(dataset)` checks the rest (source
columns exist, the value types fit along each chain). Every error names the feature and the op.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from recforge.config import HASH_HEADROOM, DatasetConfig
from recforge.preprocess.semantics.registry import OPS, IdRange, OpError, Value, ValueType, parse_params


class PlanError(ValueError):
    """A plan does not fit a dataset; the message names the feature (and the op)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpSpec(_Strict):
    op: str
    params: dict[str, Any] = Field(default_factory=dict)


class FeaturePlan(_Strict):
    name: str = Field(min_length=1)
    kind: Literal["dense", "sparse"]
    source: str = Field(min_length=1, description="column of the dataset the chain reads")
    ops: list[OpSpec] = Field(min_length=1)
    table_rows: int | None = Field(
        None, ge=1, description="sparse only: embedding rows, when the table is larger than the ids need "
        "(RAP's plan 0 gives bucketize's 4 ids a 65,536-row table); default: exactly the id range"
    )

    @model_validator(mode="after")
    def _check_ops(self) -> FeaturePlan:
        for i, spec in enumerate(self.ops):
            try:
                parsed = parse_params(spec.op, spec.params)
            except OpError as e:
                raise ValueError(f"feature {self.name!r}, op #{i} {spec.op!r}: {e}") from None
            spec.params = parsed.model_dump(by_alias=True)  # canonical: defaults filled in
        if self.kind == "sparse":
            _ = self.num_embeddings  # raises when the ids have no bound
        elif self.table_rows is not None:
            raise ValueError(f"feature {self.name!r}: table_rows is for sparse features only")
        return self

    def parsed_ops(self) -> list[tuple[str, Any]]:
        """(op name, typed params) in chain order."""
        return [(s.op, parse_params(s.op, s.params)) for s in self.ops]

    def id_range(self) -> IdRange:
        rng: IdRange = None
        for op, p in self.parsed_ops():
            rng = OPS[op].out_ids(p, rng)
        return rng

    @property
    def num_embeddings(self) -> int:
        """Embedding rows a sparse feature needs: its ids lie in [0, num_embeddings)."""
        rng = self.id_range()
        if rng is None or rng[0] < 0:
            chain = " -> ".join(s.op for s in self.ops)
            raise ValueError(
                f"feature {self.name!r}: ids from op chain {chain} are "
                f"{'unbounded' if rng is None else f'in [{rng[0]}, {rng[1]}), may be negative'}; a sparse feature "
                "needs ids in [0, N): end it with sigrid_hash, bucketize, mapid or clamp(lo >= 0)"
            )
        if self.table_rows is not None:
            if self.table_rows < rng[1]:
                raise ValueError(
                    f"feature {self.name!r}: table_rows={self.table_rows} is smaller than the id range "
                    f"[0, {rng[1]}) its ops produce"
                )
            return self.table_rows
        return rng[1]

    def values(self, source_kind: str = "sparse") -> Value:
        """The type and width of the chain's output for a scalar source column (OpError if a step does not fit)."""
        v = Value("raw", 1)
        for op, p in self.parsed_ops():
            v = OPS[op].out(p, v, source_kind)
        return v

    @property
    def width(self) -> int:
        """Values per row for a scalar source column (a list source column has its own length per row)."""
        try:
            return self.values("dense").width
        except OpError:  # widths do not depend on the source kind, only the type checks do
            return self.values("sparse").width

    def check_chain(self, source_kind: str) -> ValueType:
        """Walk the value types along the chain; PlanError names the feature and the op that does not fit."""
        v = Value("raw", 1)
        for i, (op, p) in enumerate(self.parsed_ops()):
            try:
                v = OPS[op].out(p, v, source_kind)
            except OpError as e:
                raise PlanError(f"feature {self.name!r} (source {self.source!r}), op #{i} {op!r}: {e}") from None
        want = "float" if self.kind == "dense" else "id"
        if v.type != want:
            raise PlanError(
                f"feature {self.name!r}: op chain ends with {self.ops[-1].op!r} giving {v.type} values, "
                f"a {self.kind} feature needs {want} values"
            )
        if self.kind == "dense" and v.width != 1:
            raise PlanError(
                f"feature {self.name!r}: op chain ends with {self.ops[-1].op!r} giving {v.width} values per row, "
                "a dense feature needs one (end it with firstx(1))"
            )
        return v.type


class Plan(_Strict):
    name: str = "plan"
    features: list[FeaturePlan] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Plan:
        names = [f.name for f in self.features]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"feature names must be unique, repeated: {dupes}")
        return self

    def dense_features(self) -> list[str]:
        return [f.name for f in self.features if f.kind == "dense"]

    def sparse_features(self) -> list[str]:
        return [f.name for f in self.features if f.kind == "sparse"]

    def tables(self) -> list[tuple[str, int]]:
        """(feature name, num_embeddings) of every sparse feature, in plan order."""
        return [(f.name, f.num_embeddings) for f in self.features if f.kind == "sparse"]

    def validate_for(self, dataset: DatasetConfig) -> None:
        """Raise PlanError unless every source column exists in `dataset` and every chain type-checks."""
        kinds = {n: "dense" for n in dataset.dense_names} | {n: "sparse" for n in dataset.sparse_names}
        for f in self.features:
            if f.source not in kinds:
                raise PlanError(
                    f"feature {f.name!r}: source column {f.source!r} (read by op #0 {f.ops[0].op!r}) is not a dense "
                    f"or sparse column of dataset {dataset.name!r}"
                )
            f.check_chain(kinds[f.source])

    def sources(self) -> list[str]:
        """The dataset columns the plan reads, in first-use order."""
        return list(dict.fromkeys(f.source for f in self.features))

    def with_table_cap(self, table_cap: int) -> Plan:
        """A copy whose sigrid_hash moduli and table_rows are at most `table_cap` (PipelineConfig.table_cap)."""
        if table_cap < 1:
            raise ValueError(f"with_table_cap: table_cap must be >= 1, got {table_cap}")
        data = self.model_dump(mode="json")
        for f in data["features"]:
            for spec in f["ops"]:
                if spec["op"] == "sigrid_hash":
                    spec["params"]["M"] = min(spec["params"]["M"], table_cap)
            if f.get("table_rows") is not None:
                bound = FeaturePlan.model_validate({**f, "table_rows": None}).num_embeddings
                f["table_rows"] = max(min(f["table_rows"], table_cap), bound)
        capped = Plan.model_validate(data)
        return capped if capped != self else self

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"plan file not found: {path}")
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        if data is None:
            raise ValueError(f"plan file is empty: {path}")
        return cls.model_validate(data)

    def save(self, path: str | Path) -> Path:
        """Write JSON (.json) or YAML (.yaml/.yml) atomically (temp file + rename)."""
        path = Path(path)
        data = self.model_dump(mode="json")
        text = json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path


def criteo_plan(dataset: DatasetConfig, table_cap: int) -> Plan:
    """RAP plan 0: dense fill_null(0) -> logit(1e-5);
    sparse fill_null(0) -> sigrid_hash(0, min(cardinality, table_cap)) -> firstx(1). A benchmark preset since the
    default became `schema_plan` (logit turns every count above 1 into the same +11.5)."""
    if table_cap < 1:
        raise ValueError(f"criteo_plan: table_cap must be >= 1, got {table_cap}")
    dense = [
        FeaturePlan(name=f.name, kind="dense", source=f.name,
                    ops=[OpSpec(op="fill_null", params={"value": 0}), OpSpec(op="logit", params={"eps": 1e-5})])
        for f in dataset.dense
    ]
    sparse = [
        FeaturePlan(name=f.name, kind="sparse", source=f.name,
                    ops=[OpSpec(op="fill_null", params={"value": 0}),
                         OpSpec(op="sigrid_hash", params={"salt": 0, "M": f.table_rows(table_cap, headroom=1)}),
                         OpSpec(op="firstx", params={"X": 1})])
        for f in dataset.sparse
    ]
    plan = Plan(name=f"rap_plan0_{dataset.name}_cap{table_cap}", features=dense + sparse)
    plan.validate_for(dataset)
    return plan


MISSING_SUFFIX = "_missing"  # schema_plan's missing-indicator inputs


def schema_plan(dataset: DatasetConfig, table_cap: int, hash_headroom: int = HASH_HEADROOM) -> Plan:
    """The default plan, derived from the dataset's column roles (docs/data.md#default-preprocessing-plan):
    dense: fill_null(0) -> clamp(lo, hi) when the column sets `clip` -> log1p when its transform is log1p;
    then, per dense column with `missing_indicator` (the default), `<name>_missing`: fill_null(-1) -> clamp(-1, 0)
    (-1 missing or negative, 0 present): fill_null(0) alone makes a missing count look like a 0;
    categorical: fill_null(0) -> sigrid_hash(0, table rows) -> firstx(1);
    multi_hot: fill_null(0) -> sigrid_hash(0, table rows) -> firstx(max_length) (up to max_length ids per row).
    Table rows: min(cardinality x hash_headroom, table_cap), table_cap when the cardinality is not given: hashing
    n values into n rows would make ~63% of them share a row, 64 n rows about 1.5%."""
    if table_cap < 1:
        raise ValueError(f"schema_plan: table_cap must be >= 1, got {table_cap}")
    if hash_headroom < 1:
        raise ValueError(f"schema_plan: hash_headroom must be >= 1, got {hash_headroom}")
    features = []
    for d in dataset.dense:
        ops = [OpSpec(op="fill_null", params={"value": 0})]
        if d.clip is not None:
            ops.append(OpSpec(op="clamp", params={"lo": d.clip[0], "hi": d.clip[1]}))
        if d.transform == "log1p":
            ops.append(OpSpec(op="log1p"))
        features.append(FeaturePlan(name=d.name, kind="dense", source=d.name, ops=ops))
    taken = {c.name for c in dataset.columns}
    for d in dataset.dense:
        if d.missing_indicator and f"{d.name}{MISSING_SUFFIX}" in taken:
            raise ValueError(f"schema_plan: column {d.name!r}'s missing indicator would be named "
                             f"{d.name}{MISSING_SUFFIX!s}, which is another column's name; set "
                             f"`missing_indicator: false` on {d.name!r} or rename that column")
    features += [FeaturePlan(name=f"{d.name}{MISSING_SUFFIX}", kind="dense", source=d.name,
                             ops=[OpSpec(op="fill_null", params={"value": -1}),
                                  OpSpec(op="clamp", params={"lo": -1, "hi": 0})])
                 for d in dataset.dense if d.missing_indicator]
    for c in dataset.sparse:
        keep = getattr(c, "max_length", 1) if c.multi_hot else 1
        features.append(FeaturePlan(
            name=c.name, kind="sparse", source=c.name,
            ops=[OpSpec(op="fill_null", params={"value": 0}),
                 OpSpec(op="sigrid_hash", params={"salt": 0, "M": c.table_rows(table_cap, hash_headroom)}),
                 OpSpec(op="firstx", params={"X": keep})]))
    plan = Plan(name=f"schema_{dataset.name}_cap{table_cap}_x{hash_headroom}", features=features)
    plan.validate_for(dataset)
    return plan
