"""The co-run schedule as data: which fused kernels (or parts of them) run in which training stage.

`CorunSchedule` (a JSON round trip, validated against a compiled plan) holds `Assignment`s in execution order;
`executable_parts` turns them into the fused groups the co-run runtime runs. The runtime depends on this API.
How the scheduler fills it: docs/rap.md#the-scheduler.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from recforge.preprocess.planning.compiler import CompiledPlan, FusedGroup
from recforge.rap.profiling.stages import STAGES

SCHEDULE_VERSION = 1


class ScheduleError(ValueError):
    """A co-run schedule does not fit the compiled plan; the message names the group / feature / stage."""


@dataclass(frozen=True)
class Assignment:
    """One fused group, or a part of it, in one stage.

    `group`: the group's `FusedGroup.name` ("L1:sigrid_hash_sparsex26"), as the fused executor's `describe()`
    lists it. `features`: the plan features (graph.outputs keys) it computes the group's op for, all of the
    group's (the whole kernel, in `group_features` order) or a subset (a split part, which keeps each node's
    features together: `split_units`)."""

    stage: str
    group: str
    features: tuple[str, ...]
    predicted_ms: float


@dataclass(frozen=True)
class ExecPart:
    assignment: Assignment
    key: int
    group: FusedGroup


def groups_by_name(compiled: CompiledPlan) -> dict[str, FusedGroup]:
    return {g.name: g for g in compiled.groups}


def split_units(compiled: CompiledPlan, group: FusedGroup) -> list[tuple[str, ...]]:
    """Per node of the group (in group order), the features its output feeds. A node shared by several features
    (a common prefix) computes them together, so a split keeps them together. Units of one group are disjoint:
    a feature's chain has one node per layer."""
    order = {f: i for i, f in enumerate(compiled.graph.outputs)}
    return [tuple(sorted(compiled.graph.features_of(n), key=order.__getitem__)) for n in group.nodes]


def group_features(compiled: CompiledPlan, group: FusedGroup) -> tuple[str, ...]:
    return tuple(f for unit in split_units(compiled, group) for f in unit)


def _group(compiled: CompiledPlan, name: str) -> FusedGroup:
    found = groups_by_name(compiled).get(name)
    if found is None:
        raise ScheduleError(f"unknown fused group {name!r} in plan {compiled.plan.name!r}; groups: "
                            f"{[g.name for g in compiled.groups]}")
    return found


def restrict(compiled: CompiledPlan, group: FusedGroup | str, features: Iterable[str]) -> FusedGroup:
    """The part of `group` that computes `features`: the same layer/op/class with only their nodes
    (ScheduleError when that would split a node's features)."""
    g = _group(compiled, group) if isinstance(group, str) else group
    wanted = list(features)
    known = set(group_features(compiled, g))
    unknown = [f for f in wanted if f not in known]
    if unknown:
        raise ScheduleError(f"group {g.name!r}: features {unknown} are not computed by it; "
                            f"its features: {sorted(known)}")
    wanted_set = set(wanted)
    nodes = []
    for node, unit in zip(g.nodes, split_units(compiled, g), strict=True):
        inside = [f for f in unit if f in wanted_set]
        if inside and len(inside) != len(unit):
            raise ScheduleError(f"group {g.name!r}: node {node} computes features {list(unit)} together; a part "
                                f"cannot take only {inside}")
        if inside:
            nodes.append(node)
    if not nodes:
        raise ScheduleError(f"group {g.name!r}: a part needs at least one feature")
    return FusedGroup(layer=g.layer, op=g.op, cls=g.cls, nodes=tuple(nodes))


@dataclass
class CorunSchedule:
    """Assignments in execution order: stages in `stages` order, within a stage in list order. `to_json` /
    `from_json` round-trip it (ScheduleError naming a missing key); `by_stage()` has every stage of `stages`,
    possibly empty; `validate(compiled)` raises ScheduleError naming the plan, stage, group or feature."""

    stages: tuple[str, ...]
    assignments: list[Assignment]
    plan_name: str
    meta: dict[str, Any] = field(default_factory=dict)

    def by_stage(self) -> dict[str, list[Assignment]]:
        out: dict[str, list[Assignment]] = {s: [] for s in self.stages}
        for a in self.assignments:
            if a.stage not in out:
                raise ScheduleError(f"assignment of group {a.group!r} names stage {a.stage!r}, "
                                    f"not one of {list(self.stages)}")
            out[a.stage].append(a)
        return out

    def predicted_ms_by_stage(self) -> dict[str, float]:
        return {s: sum(a.predicted_ms for a in items) for s, items in self.by_stage().items()}

    # ----------------------------------------------------------------- JSON

    def to_json(self) -> str:
        return json.dumps({
            "version": SCHEDULE_VERSION, "plan_name": self.plan_name, "stages": list(self.stages),
            "assignments": [{**asdict(a), "features": list(a.features)} for a in self.assignments],
            "meta": self.meta,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CorunSchedule:
        data = json.loads(text)
        for key in ("plan_name", "stages", "assignments"):
            if key not in data:
                raise ScheduleError(f"co-run schedule JSON: missing key {key!r}")
        if data.get("version", SCHEDULE_VERSION) != SCHEDULE_VERSION:
            raise ScheduleError(f"co-run schedule JSON: version {data['version']}, this code reads {SCHEDULE_VERSION}")
        items = []
        for i, a in enumerate(data["assignments"]):
            missing = [k for k in ("stage", "group", "features", "predicted_ms") if k not in a]
            if missing:
                raise ScheduleError(f"co-run schedule JSON: assignment #{i} misses {missing}")
            items.append(Assignment(stage=a["stage"], group=a["group"], features=tuple(a["features"]),
                                    predicted_ms=float(a["predicted_ms"])))
        return cls(stages=tuple(data["stages"]), assignments=items, plan_name=data["plan_name"],
                   meta=data.get("meta", {}))

    # ----------------------------------------------------------------- checks

    def validate(self, compiled: CompiledPlan) -> None:
        """ScheduleError unless: the stages are RAP's (a subset, in order), every assignment names a known stage,
        group and features of that group, every fused group's features are covered exactly once (a node's
        features together), the list is in stage order, and every node runs after its parent."""
        if compiled.plan.name != self.plan_name:
            raise ScheduleError(f"schedule is for plan {self.plan_name!r}, the compiled plan is {compiled.plan.name!r}")
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ScheduleError(f"unknown stages {bad}; RAP's stages are {list(STAGES)}")
        if list(self.stages) != [s for s in STAGES if s in self.stages]:
            raise ScheduleError(f"stages {list(self.stages)} are not in execution order {list(STAGES)}")
        seen: dict[str, dict[str, int]] = {g.name: {} for g in compiled.groups}
        position_of_node: dict[int, int] = {}
        last_stage = 0
        for i, a in enumerate(self.assignments):
            if a.stage not in self.stages:
                raise ScheduleError(f"assignment #{i} (group {a.group!r}) names stage {a.stage!r}, not one of "
                                    f"{list(self.stages)}")
            stage_index = self.stages.index(a.stage)
            if stage_index < last_stage:
                raise ScheduleError(f"assignment #{i} (group {a.group!r}) in stage {a.stage!r} comes after stage "
                                    f"{self.stages[last_stage]!r}: list assignments in stage order")
            last_stage = stage_index
            if a.predicted_ms < 0:
                raise ScheduleError(f"assignment #{i} (group {a.group!r}): predicted_ms {a.predicted_ms} < 0")
            part = restrict(compiled, a.group, a.features)
            for f in a.features:
                if f in seen[a.group]:
                    raise ScheduleError(f"group {a.group!r}: feature {f!r} is scheduled twice (assignments "
                                        f"#{seen[a.group][f]} and #{i})")
                seen[a.group][f] = i
            for n in part.nodes:
                position_of_node[n] = i
        for g in compiled.groups:
            missing = [f for f in group_features(compiled, g) if f not in seen[g.name]]
            if missing:
                raise ScheduleError(f"fused group {g.name!r}: features {missing} are not scheduled in any stage")
        for node in compiled.graph.nodes:
            if node.parent is not None and position_of_node[node.parent] > position_of_node[node.id]:
                raise ScheduleError(f"node {node.id} ({node.op} of {node.source!r}) is scheduled in assignment "
                                    f"#{position_of_node[node.id]}, before its input (assignment "
                                    f"#{position_of_node[node.parent]})")


def executable_parts(compiled: CompiledPlan, schedule: CorunSchedule) -> list[ExecPart]:
    """The schedule's assignments as runnable fused groups, in execution order, after validating it.

    Run a part with `FusedExecutor.run_group(part.key, part.group, raw, vals)`; `part.group` holds only the nodes
    of the assignment's features. The fused executor caches each group's kernel parameters under that first
    argument, so a split part must not reuse its whole group's index: `key` is the group's index in
    compiled.groups for a whole group and len(compiled.groups) + the assignment's index for a part. Dense-class
    groups run over the local batch, sparse-class ones over the rows the worker preprocesses for the tables it
    owns (recforge.rap.mapping.milp); the executor does not care which."""
    schedule.validate(compiled)
    index = {g.name: i for i, g in enumerate(compiled.groups)}
    parts = []
    for i, a in enumerate(schedule.assignments):
        group = _group(compiled, a.group)
        part = restrict(compiled, group, a.features)
        key = index[a.group] if part.nodes == group.nodes else len(compiled.groups) + i
        parts.append(ExecPart(assignment=a, key=key, group=part))
    return parts


def whole_kernel_schedule(compiled: CompiledPlan, stage: str, predicted_ms: dict[str, float] | None = None,
                          meta: dict[str, Any] | None = None) -> CorunSchedule:
    """Every fused group, whole, in one stage (execution order): the simplest valid schedule."""
    predicted_ms = predicted_ms or {}
    items = [Assignment(stage=stage, group=g.name, features=group_features(compiled, g),
                        predicted_ms=float(predicted_ms.get(g.name, 0.0))) for g in compiled.groups]
    return CorunSchedule(stages=STAGES, assignments=items, plan_name=compiled.plan.name, meta=dict(meta or {}))
