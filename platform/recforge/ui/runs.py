"""Pipeline runs as the stages recorded them: $RECFORGE_HOME/runs/<experiment>/<run key>/<stage>/outputs.json.

Read-only. A run is whatever directory exists; a stage without outputs.json is missing, one whose file does not
parse or does not hold the stage's model (recforge.pipelines.outputs) is reported with the reason (the fields).
Nothing here follows a path outside the run's directory.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recforge.pipelines.context import EXPERIMENT
from recforge.pipelines.outputs import (
    STAGE_OUTPUTS,
    OutputsError,
    OutputsT,
    PlanOutputs,
    StageOutputs,
    parse_outputs,
)
from recforge.settings import recforge_home

RUN_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")  # what recforge.pipelines.context.run_key_from produces
MAX_JSON_BYTES = 8 << 20
STAGES = list(STAGE_OUTPUTS)  # the pipeline's stages in order (recforge.pipelines.runner.STAGES)


class RunNotFound(LookupError):
    pass


@dataclass
class StageRecord:
    name: str
    outputs: StageOutputs | None = None  # outputs.json as the stage's model, where it validates
    raw: dict[str, Any] | None = None  # what outputs.json holds, shown even when it does not validate
    problem: str | None = None  # outputs.json exists but cannot be read or does not validate

    @property
    def done(self) -> bool:
        return self.outputs is not None


@dataclass
class RunRecord:
    run_key: str
    path: Path
    modified: float
    stages: dict[str, StageRecord] = field(default_factory=dict)

    def read(self, model: type[OutputsT]) -> OutputsT | None:
        """A stage's recorded outputs as its model; None where the stage has none (or they do not validate)."""
        record = self.stages.get(model.stage)
        return record.outputs if record is not None and isinstance(record.outputs, model) else None

    def raw(self, stage: str) -> dict[str, Any] | None:
        record = self.stages.get(stage)
        return record.raw if record else None

    @property
    def done(self) -> list[str]:
        return [s for s, r in self.stages.items() if r.done]

    @property
    def missing(self) -> list[str]:
        return [s for s, r in self.stages.items() if not r.done]

    def inside(self, recorded: str | None, stage: str) -> Path | None:
        """A file a stage recorded by absolute path, resolved inside this run's stage directory only
        (the run may have moved with $RECFORGE_HOME; a path pointing elsewhere is not followed)."""
        if not recorded:
            return None
        stage_dir = (self.path / stage).resolve()
        candidate = Path(recorded).resolve()
        if not candidate.is_relative_to(stage_dir):
            candidate = (stage_dir / Path(recorded).name).resolve()
        return candidate if candidate.is_relative_to(stage_dir) and candidate.is_file() else None


def runs_root(home: Path | None = None, experiment: str = EXPERIMENT) -> Path:
    return (home or recforge_home()) / "runs" / experiment


def check_run_key(run_key: str) -> str:
    if not RUN_KEY.match(run_key) or run_key in (".", ".."):
        # not echoed: the key is whatever the caller put in the URL
        raise ValueError("the run key in the URL is not a pipeline run key (1-200 letters, digits, '_', '.', '-')")
    return run_key


def read_json(path: Path) -> tuple[Any, str | None]:
    """(data, None) or (None, why not)."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            return None, f"{path.name} is {size:,} bytes (limit {MAX_JSON_BYTES:,})"
        return json.loads(path.read_text()), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path.name} unreadable: {type(e).__name__}: {e}"


def _load(path: Path) -> RunRecord:
    run = RunRecord(run_key=path.name, path=path, modified=path.stat().st_mtime)
    for stage in STAGES:
        record = StageRecord(stage)
        out = path / stage / "outputs.json"
        if out.is_file():
            data, problem = read_json(out)
            if problem is None and not isinstance(data, dict):
                data, problem = None, f"outputs.json holds a {type(data).__name__}, not an object"
            record.raw, record.problem = data, problem
            if data is not None:
                try:
                    record.outputs = parse_outputs(STAGE_OUTPUTS[stage], data, "outputs.json")
                except OutputsError as e:
                    record.problem = str(e)
            run.modified = max(run.modified, out.stat().st_mtime)
        run.stages[stage] = record
    return run


def list_runs(root: Path, limit: int = 200) -> list[RunRecord]:
    """Newest first (by the latest outputs written)."""
    if not root.is_dir():
        return []
    runs = [_load(p) for p in root.iterdir() if p.is_dir() and RUN_KEY.match(p.name) and not p.name.startswith(".")]
    return sorted(runs, key=lambda r: r.modified, reverse=True)[:limit]


def load_run(root: Path, run_key: str) -> RunRecord:
    path = root / check_run_key(run_key)
    if not path.is_dir():
        raise RunNotFound(f"no pipeline run {run_key!r} under {root}")
    return _load(path)


def load_plan(run: RunRecord) -> tuple[dict[str, Any] | None, str | None]:
    """The preprocessing plan the run trained with (plan_resources' preprocess_plan.json)."""
    out = run.read(PlanOutputs)
    if out is None:
        return None, None
    path = run.inside(out.plan_path, "plan_resources")
    if path is None:
        return None, "the plan file recorded by plan_resources is missing"
    data, problem = read_json(path)
    if problem is None and not (isinstance(data, dict) and isinstance(data.get("features"), list)):
        return None, "the plan file has no feature list"
    return data, problem
