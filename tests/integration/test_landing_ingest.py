"""generate + ingest from the landing zone (source_uri): local files used where they are, remote ones (fsspec
memory://) copied into the run; holdout next_day and split; re-running a day replaces its outputs and reuses its
MLflow runs; a missing day names the path and the day. wait_for_data passes landed days, defers otherwise and
times out naming what is missing (its place in the DAG: tests/integration/test_dag.py)."""
import asyncio
import json
from datetime import UTC, date, datetime
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pyarrow.parquet as pq
import pytest
from airflow.sdk.exceptions import AirflowSensorTimeout, TaskDeferred

from recforge.config import PipelineConfig
from recforge.data.manifest import Manifest
from recforge.pipelines import landing
from recforge.pipelines.context import RunContext, run_key_from
from recforge.pipelines.landing_sensor import LandingSensor
from recforge.pipelines.landing_trigger import LandingTrigger
from recforge.pipelines.outputs import GenerateOutputs, IngestOutputs
from recforge.pipelines.stages.data import generate, ingest
from recforge.tracking import TrackingStore

RUN_DAY = date(2026, 3, 4)
ROWS = 1000


@pytest.fixture(scope="module")
def zone(tmp_path_factory) -> Path:
    """Synthetic days 2026-03-03 .. 2026-03-05 landed once for the module."""
    path = tmp_path_factory.mktemp("landing")
    landing.land_synthetic(path, date(2026, 3, 3), 3, rows_per_day=ROWS, seed=5)
    return path


@pytest.fixture(scope="module")
def home(module_home):
    return module_home


def _ctx(home: Path, key: str, **config) -> RunContext:
    cfg = PipelineConfig.model_validate({"rows_per_shard": 400, **config})
    return RunContext.create(key, cfg, home=home, data_day=landing.first_day(RUN_DAY, cfg))


def _rows(manifest_dir: str) -> list:
    m = Manifest.load(manifest_dir)
    return [r for i in range(len(m.shards)) for r in pq.read_table(m.shard_path(i)).to_pylist()]


def test_land_synthetic_days_are_stable_and_carry_their_ceiling(zone, tmp_path):
    files = sorted(p.name for p in zone.glob("day_*"))
    assert files == ["day_2026-03-03.tsv.gz", "day_2026-03-04.tsv.gz", "day_2026-03-05.tsv.gz"]
    side = json.loads((zone / "_synthetic" / "day_2026-03-04.tsv.gz.json").read_text())
    assert 0.6 < side["bayes_auc"] < 1 and side["rows"] == ROWS and side["day"] == "2026-03-04"
    mtime = (zone / "day_2026-03-04.tsv.gz").stat().st_mtime_ns
    landing.land_synthetic(zone, date(2026, 3, 4), 1, rows_per_day=ROWS, seed=5)  # again: kept as it is
    assert (zone / "day_2026-03-04.tsv.gz").stat().st_mtime_ns == mtime
    # a day's rows do not depend on the range that landed it
    other = landing.land_synthetic(tmp_path, date(2026, 3, 4), 1, rows_per_day=ROWS, seed=5)
    assert other[0].read_bytes() == (zone / "day_2026-03-04.tsv.gz").read_bytes()
    assert not [p for p in zone.rglob(".*")], "no temp files left"


def test_split_holdout_is_the_run_days_last_rows_and_a_rerun_replaces_it(home, zone):
    ctx = _ctx(home, "backfill__2026-03-04T00:00:00+00:00", source_uri=str(zone / "day_{ds}.tsv.gz"),
               train_days=2, holdout="split", holdout_fraction=0.1)
    gen = generate(ctx)
    assert gen.files == [str(zone / "day_2026-03-03.tsv.gz"), str(zone / "day_2026-03-04.tsv.gz")]  # where they are
    assert gen.synthetic is False and gen.run_day == "2026-03-04" and gen.days == ["2026-03-03", "2026-03-04"]
    assert gen.holdout == "split" and gen.sources == gen.files
    assert gen.bayes_auc and len(gen.bayes_auc) == 2  # from the synthetic days' reports: the summary's ceiling
    first = ingest(ctx)
    assert (first.train.rows, first.holdout.rows) == (2 * ROWS - 100, 100)
    # the held-out rows are the run day's last 100, in order; the train split keeps everything before them
    whole = RunContext.create("whole", {"rows_per_shard": 400}, home=home)
    whole_dir = whole.run_dir / "all"
    from recforge.data.ingest import ingest as ingest_files

    ingest_files([Path(f) for f in gen.files], ctx.config.dataset(), whole_dir, rows_per_shard=400,
                 max_bad_fraction=0.01)
    everything = _rows(str(whole_dir))
    assert _rows(first.holdout.manifest_dir) == everything[-100:]
    assert _rows(first.train.manifest_dir) == everything[:-100]
    Manifest.load(first.train.manifest_dir).verify()
    Manifest.load(first.holdout.manifest_dir).verify()

    again = ingest(ctx)  # the same logical day again: replaced, not duplicated
    assert again.model_dump(exclude={"stats"}) == first.model_dump(exclude={"stats"})
    assert len(list(Path(again.holdout.manifest_dir).glob("part-*.parquet"))) == 1
    runs = TrackingStore().stage_runs(ctx.experiment, ctx.run_key)
    assert sorted(runs) == ["generate", "ingest", "pipeline"]
    assert not [p for p in ctx.run_dir.iterdir() if p.name.startswith(".")]


def test_remote_landing_files_are_copied_into_the_run_next_day_held_out(home, zone):
    fs = fsspec.filesystem("memory")
    for name in ("day_2026-03-04.tsv.gz", "day_2026-03-05.tsv.gz"):
        fs.pipe(f"memory://landing-test/dt={name[4:14]}/part-0.tsv.gz", (zone / name).read_bytes())
    fs.pipe("memory://landing-test/dt=2026-03-04/_SUCCESS", b"")
    ctx = _ctx(home, "scheduled__2026-03-04T00:00:00+00:00", source_uri="memory://landing-test/dt={ds}/part-*.tsv.gz")
    gen = generate(ctx)
    raw = ctx.stage_dir("generate") / "raw"
    assert gen.files == [str(raw / "2026-03-04" / "part-0.tsv.gz"), str(raw / "2026-03-05" / "part-0.tsv.gz")]
    assert gen.sources == ["memory:///landing-test/dt=2026-03-04/part-0.tsv.gz",
                           "memory:///landing-test/dt=2026-03-05/part-0.tsv.gz"]
    assert Path(gen.files[0]).read_bytes() == (zone / "day_2026-03-04.tsv.gz").read_bytes()
    assert gen.bayes_auc is None and gen.days == ["2026-03-04", "2026-03-05"]  # no generator report here
    out = ingest(ctx)
    assert (out.train.rows, out.holdout.rows) == (ROWS, ROWS)  # the run's day trained on, the next one held out
    assert Manifest.load(out.holdout.manifest_dir).sources == [str(Path(gen.files[1]).resolve())]
    assert ctx.read(GenerateOutputs) == gen


def test_a_missing_day_names_the_path_and_the_day(home, zone):
    ctx = _ctx(home, "manual__missing", source_uri=str(zone / "day_{ds}.tsv.gz"), train_days=3)
    with pytest.raises(FileNotFoundError, match=r"day 2026-03-02 \(train day of run day 2026-03-04\).*"
                                                 r"day_2026-03-02\.tsv\.gz"):
        generate(ctx)
    assert not ctx.stage_dir("generate").exists()
    assert TrackingStore().stage_runs(ctx.experiment, ctx.run_key)["generate"].info.status == "FAILED"
    with pytest.raises(FileNotFoundError):
        ctx.read(IngestOutputs)


def _airflow_context(params: dict, run_id: str) -> dict:
    """What wait_for_data reads of a task's context: the run's Params, its DAG run and its logical date."""
    return {"params": params, "dag_run": SimpleNamespace(run_id=run_id, run_after=None),
            "logical_date": datetime(2026, 3, 4, tzinfo=UTC)}


def test_the_sensor_passes_landed_days_and_defers_then_times_out_naming_what_is_missing(home, zone, tmp_path):
    sensor = LandingSensor(task_id="wait_for_data")
    assert sensor.deferrable
    assert sensor.execute(_airflow_context({}, "manual__synthetic")) == {"source": "synthetic"}
    landed = {"source_uri": str(zone / "day_{ds}.tsv.gz"), "sensor_poke_s": 0.01}
    assert sensor.execute(_airflow_context(landed, "manual__landed")) == {
        "source": "landing", "run_day": "2026-03-04", "files": 2}

    # nothing landed in this zone: deferred to the trigger with the run's window and deadline
    empty = {"source_uri": str(tmp_path / "day_{ds}.tsv.gz"), "sensor_timeout_s": 0.2, "sensor_poke_s": 0.05}
    context = _airflow_context(empty, "scheduled__2026-03-04T00:00:00+00:00_late")
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context)
    trigger = deferred.value.trigger
    assert isinstance(trigger, LandingTrigger) and deferred.value.method_name == "execute_complete"
    assert [w["pattern"] for w in trigger.expected] == [str(tmp_path / "day_2026-03-04.tsv.gz"),
                                                        str(tmp_path / "day_2026-03-05.tsv.gz")]
    event = asyncio.run(asyncio.wait_for(anext(trigger.run()), 30))  # the deadline passes: a timeout event
    with pytest.raises(AirflowSensorTimeout, match=r"run day 2026-03-04 did not arrive within 0.2 s.*"
                                                   r"no file matches .*day_2026-03-04\.tsv\.gz.*day_2026-03-05"):
        sensor.execute_complete(context, event=event.payload)
    # the DAG run's MLflow pipeline run says why, as a data error
    parent = TrackingStore().stage_runs("recforge_daily", run_key_from(context["dag_run"].run_id))["pipeline"]
    assert parent.info.status == "FAILED" and parent.data.tags["recforge.error_kind"] == "data"
    assert "day_2026-03-05.tsv.gz" in parent.data.tags["recforge.error"]
