"""What every stage of one pipeline run shares: its key, its config, where its outputs live."""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recforge.config import PipelineConfig
from recforge.pipelines.outputs import OutputsT, parse_outputs
from recforge.settings import recforge_home

EXPERIMENT = "recforge_daily"


def run_key_from(dag_run_id: str) -> str:
    """Airflow run ids contain ':' and '+'; keep a filesystem- and filter-safe key."""
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", dag_run_id).strip("_")
    if not key:
        raise ValueError(f"run id {dag_run_id!r} gives an empty run key")
    return key


@dataclass
class RunContext:
    run_key: str
    config: PipelineConfig
    home: Path = field(default_factory=recforge_home)
    experiment: str = EXPERIMENT
    tracking_uri: str | None = None
    # calendar day of the run's first synthetic day file (the daily DAG: logical date - train_days), so each
    # day's run draws new rows from the same hidden model; 0 outside Airflow
    data_day: int = 0
    # how the run was started: Airflow's DagRun.run_type (scheduled, manual, backfill, ...); "manual" outside
    # Airflow. train.warm_start 'auto' warm-starts scheduled runs only
    run_type: str = "manual"

    @classmethod
    def create(cls, run_key: str, config: dict[str, Any] | PipelineConfig, **kw) -> RunContext:
        cfg = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
        return cls(run_key=run_key_from(run_key), config=cfg, **kw)

    @property
    def run_dir(self) -> Path:
        return self.home / "runs" / self.experiment / self.run_key

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def read(self, model: type[OutputsT]) -> OutputsT:
        """The recorded outputs of a finished stage as its model (`ctx.read(IngestOutputs)`); a later stage reads
        only these. A missing file is FileNotFoundError, one that does not validate OutputsError naming the fields."""
        stage = model.stage
        path = self.stage_dir(stage) / "outputs.json"
        if not path.exists():
            raise FileNotFoundError(f"stage {stage!r} of run {self.run_key} has no recorded outputs at {path}")
        return parse_outputs(model, path.read_text(), f"stage {stage!r} of run {self.run_key} ({path})")


class StageWriter:
    """Build a stage's outputs in a temp dir; `commit` swaps it in, so a half-done stage is never seen."""

    def __init__(self, ctx: RunContext, stage: str):
        self.final = ctx.stage_dir(stage)
        self.tmp = self.final.with_name(f".{stage}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)

    def commit(self, outputs: OutputsT) -> OutputsT:
        """Write `outputs` as the stage's outputs.json and swap the stage in; returns them as read back."""
        if type(outputs).stage != self.final.name:
            raise TypeError(f"stage {self.final.name!r} cannot commit {type(outputs).__name__} "
                            f"(the outputs of {type(outputs).stage!r})")
        # paths inside outputs refer to the final location
        text = outputs.model_dump_json(indent=2).replace(str(self.tmp), str(self.final))
        back = parse_outputs(type(outputs), text, f"{self.final.name}/outputs.json")  # validated before it is seen
        (self.tmp / "outputs.json").write_text(text)
        old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        shutil.rmtree(old, ignore_errors=True)
        return back

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
