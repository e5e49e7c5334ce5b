"""The landing zone: which files a run needs (`source_uri` per day), finding them (fsspec: local paths stay paths,
remote files are copied into the run with temp + rename), and seeding it with synthetic days (`land_synthetic`:
`make demo` and `recforge land-synthetic`).

Light (fsspec, no Airflow, no pyarrow): the DAG's sensor imports it at parse time. Design:
docs/data.md#landing-zone-sensor-and-backfill.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from recforge.config import PipelineConfig, load_dataset
from recforge.pipelines.landing_trigger import list_day
from recforge.pipelines.stage import InvalidInput

SIDECAR_DIR = "_synthetic"  # next to synthetic day files: their generator report (Bayes AUC); `_` hides it from globs


def expand(template: str, day: date) -> str:
    """A source_uri / ready_marker template for `day`: {ds} is YYYY-MM-DD, {ds_nodash} YYYYMMDD (Airflow's names)."""
    return template.format(ds=day.isoformat(), ds_nodash=day.strftime("%Y%m%d"))


def run_day(data_day: int, config: PipelineConfig) -> date:
    """The run's day (its logical date) from RunContext.data_day, the first training day's ordinal."""
    if data_day < 1:
        raise InvalidInput("source_uri is set but the run has no day: landing files are read for an Airflow run's "
                           "logical date (recforge_daily), or clear source_uri for synthetic days")
    return date.fromordinal(data_day + config.train_days - 1)


def first_day(run: date, config: PipelineConfig) -> int:
    """RunContext.data_day of a run on day `run`: the ordinal of its first training day."""
    return run.toordinal() - config.train_days + 1


def window(config: PipelineConfig, run: date) -> list[tuple[date, str]]:
    """(day, role) of every day a run on `run` reads: `train_days` days ending with it, then with holdout next_day
    the day after (role "holdout"); holdout split holds out the run day's last rows instead."""
    days = [(run - timedelta(days=i), "train") for i in reversed(range(config.train_days))]
    if config.holdout == "next_day":
        days.append((run + timedelta(days=1), "holdout"))
    return days


def expected(config: PipelineConfig, run: date) -> list[dict[str, Any]]:
    """What the sensor waits for: per day its role, file pattern and ready marker (LandingTrigger's `expected`)."""
    if config.source_uri is None:
        return []
    return [{"day": d.isoformat(), "role": role, "pattern": expand(config.source_uri, d),
             "marker": expand(config.ready_marker, d) if config.ready_marker else None}
            for d, role in window(config, run)]


@dataclass(frozen=True)
class LandingFile:
    day: str
    role: str
    url: str


def resolve(config: PipelineConfig, run: date) -> list[LandingFile]:
    """The landing files of a run on day `run`, in window order (a glob's matches sorted by name). A day with no file
    is FileNotFoundError naming the pattern and the day."""
    found = []
    for want in expected(config, run):
        urls = sorted(list_day(want["pattern"]))
        if not urls:
            raise FileNotFoundError(f"source_uri: no landing file for day {want['day']} ({want['role']} day of run "
                                    f"day {run.isoformat()}): nothing matches {want['pattern']}")
        found += [LandingFile(day=want["day"], role=want["role"], url=url) for url in urls]
    return found


def fetch(files: list[LandingFile], tmp_dir: Path, final_dir: Path) -> list[str]:
    """Local paths of `files`: a local file is used where it is; a remote one is copied to tmp_dir/<day>/<name>
    (temp file + rename) and named by its path under final_dir, where the stage's commit moves it."""
    paths = []
    for f in files:
        fs, path = fsspec.core.url_to_fs(f.url)
        if isinstance(fs, LocalFileSystem):
            paths.append(path)
            continue
        name = path.rstrip("/").rsplit("/", 1)[-1]
        target = tmp_dir / f.day / name
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{name}.part-{uuid.uuid4().hex[:8]}")
        try:
            fs.get_file(path, str(part))
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        paths.append(str(final_dir / f.day / name))
    return paths


def split_files(files: list[str], days: list[str] | None, holdout: str) -> tuple[list[str], list[str], list[str]]:
    """(train, held-out, run day's) files of a generate stage's outputs: the last day's files are the held-out day
    with holdout next_day, the run's day with split (then cut by rows: recforge.pipelines.holdout)."""
    days = days or [str(i) for i in range(len(files))]  # older records: one file per day
    last = [f for f, d in zip(files, days, strict=True) if d == days[-1]]
    if holdout == "split":
        return list(files), [], last
    return [f for f, d in zip(files, days, strict=True) if d != days[-1]], last, []


def sidecar_url(url: str) -> str:
    """Where land_synthetic keeps a day file's generator report: <dir>/_synthetic/<file name>.json."""
    head, _, name = url.rstrip("/").rpartition("/")
    return f"{head}/{SIDECAR_DIR}/{name}.json"


def read_sidecar(url: str) -> dict[str, Any] | None:
    """The generator report of a synthetic landing file, None for any other file."""
    try:
        with fsspec.open(sidecar_url(url), "r") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def land_synthetic(directory: str | Path, start: date, days: int, *, rows_per_day: int = 200_000, seed: int = 0,
                   dataset: str = "criteo_kaggle") -> list[Path]:
    """Write synthetic days start .. start+days-1 as directory/day_{ds}.tsv.gz (each via temp + rename; the
    generator report, with the day's Bayes AUC, first into directory/_synthetic/day_{ds}.tsv.gz.json). A calendar day
    always holds the same rows for the same seed and size, whichever range wrote it, so a day already there with
    the same report is kept as it is (its modification time too). Returns the day files."""
    from recforge.data.generator import default_cardinality_scale, generate_days  # lazy: numpy off the DAG parse

    if days < 1:
        raise ValueError(f"land_synthetic: days must be >= 1, got {days}")
    ds = load_dataset(dataset)
    # the scale of a default run (train_days 1 + the held-out day), so landed days match the synthetic source's
    scale = default_cardinality_scale(ds, rows_per_day * 2)
    directory = Path(directory)
    (directory / SIDECAR_DIR).mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(days):
        day = start + timedelta(days=i)
        target = directory / f"day_{day.isoformat()}.tsv.gz"
        side = Path(sidecar_url(str(target)))
        want = {"dataset": dataset, "seed": seed, "rows": rows_per_day, "day": day.isoformat(),
                "cardinality_scale": scale}
        old = json.loads(side.read_text()) if side.exists() else {}
        if target.exists() and {k: old.get(k) for k in want} == want:
            out.append(target)
            continue
        scratch = directory / SIDECAR_DIR / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            report = generate_days(ds, scratch, days=1, rows_per_day=rows_per_day, seed=seed, gzip=True,
                                   cardinality_scale=scale, first_day=day.toordinal())
            _write_json(side, {**want, "bayes_auc": report.bayes_auc[0], "positive_rate": report.positive_rate[0]})
            os.replace(report.files[0], target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        out.append(target)
    return out
