"""`recforge ...`: data tools, single stages, a whole pipeline in-process, and the Airflow demo."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from recforge.config import HASH_HEADROOM, PipelineConfig, dataset_preset, load_config, load_dataset
from recforge.demo import how_to_open, run_demo
from recforge.elastic.simulate.cli import app as simulate_app
from recforge.pipelines.context import RunContext
from recforge.pipelines.runner import STAGE_FUNCTIONS, STAGES
from recforge.pipelines.stage import is_data_error
from recforge.pipelines.summary import fmt, summarize
from recforge.preprocess.presets import load_plan
from recforge.settings import repo_root


class _App(typer.Typer):
    """The CLI: a DataError (the input data is bad, recforge.data.errors) prints `data error: <one line>` to stderr
    and exits 2, with no traceback; any other exception keeps typer's handling."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except Exception as e:
            if not is_data_error(e):  # (checked by class without importing recforge.data: pyarrow)
                raise
            print(f"data error: {' '.join(str(e).split())}", file=sys.stderr)
            sys.exit(2)


app = _App(help="recforge: train and serve deep learning recommendation models", no_args_is_help=True)
data_app = typer.Typer(help="raw day files: generate and validate", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(simulate_app, name="simulate")
console = Console()


def _pipeline_config(config: Path | None, overrides: dict):
    base = load_config(config).model_dump() if config else {}
    base.update({k: v for k, v in overrides.items() if v is not None})
    return PipelineConfig.model_validate(base)


@data_app.command("generate")
def data_generate(
    out: Path = typer.Argument(..., help="directory for day_*.tsv"),
    preset: str = "criteo_kaggle", days: int = 2, rows: int = 100_000, seed: int = 0, gzip: bool = False,
):
    """Synthetic Criteo-format day files with a known AUC ceiling."""
    from recforge.data.generator import generate_days  # lazy: pyarrow; the other commands start without it

    with console.status(f"generating {days} x {rows:,} rows"):
        t = time.perf_counter()
        report = generate_days(dataset_preset(preset), out, days=days, rows_per_day=rows, seed=seed, gzip=gzip)
        dt = time.perf_counter() - t
    console.print(f"wrote {len(report.files)} files to {out} ({days * rows / dt:,.0f} rows/s); "
                  f"Bayes AUC per day: {[round(a, 4) for a in report.bayes_auc]}")


@data_app.command("validate")
def data_validate(
    sources: list[Path] = typer.Argument(..., help="raw day files"),
    out: Path = typer.Option(..., help="output directory for Parquet shards + manifest"),
    dataset: str = typer.Option("criteo_kaggle", "--dataset", "--preset",
                                help="a shipped schema (criteo_kaggle, criteo_terabyte) or a schema file (.yaml)"),
    rows_per_shard: int = 50_000, max_bad_fraction: float = 0.01,
):
    """Validate raw day files of any schema into Parquet shards; bad rows go to quarantine.jsonl."""
    from recforge.data.ingest import ingest  # lazy: pyarrow; the other commands start without it

    manifest = ingest(list(sources), load_dataset(dataset), out, rows_per_shard=rows_per_shard,
                      max_bad_fraction=max_bad_fraction, progress=True)
    console.print(f"{manifest.total_rows:,} rows in {len(manifest.shards)} shards at {out}; "
                  f"{manifest.quarantined_rows:,} quarantined ({out / 'quarantine.jsonl'})")


@app.command()
def preprocess(
    manifest_dir: Path,
    plan: str = typer.Option("schema", help="'schema' (the default plan, from the dataset's column roles), "
                                            "'criteo' (RAP plan 0 over the manifest's dataset), a preset "
                                            "(plan0..plan3) or a plan JSON/YAML file"),
    executor: str = typer.Option("fused", help="eager | fused | dali"),
    table_cap: int = 100_000, batch_size: int = 8192,
    hash_headroom: int = typer.Option(HASH_HEADROOM, help="the schema plan's table rows: min(cardinality x this, cap)"),
):
    """Run a preprocessing plan over a manifest with the named executor and report throughput."""
    from recforge.data.manifest import Manifest  # lazy: pyarrow; the other commands start without it
    from recforge.data.shards import read_rows  # lazy: pyarrow
    from recforge.preprocess.batch import RawBatch  # lazy: torch; the other commands start without it
    from recforge.preprocess.executor import EXECUTORS, make_executor  # lazy: torch, torchrec

    if executor not in EXECUTORS:
        raise typer.BadParameter(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    manifest = Manifest.load(manifest_dir)
    the_plan = load_plan(plan, manifest.dataset, table_cap, hash_headroom)
    run = make_executor(executor, the_plan, manifest.dataset)
    rows, t = 0, time.perf_counter()
    with _progress() as bar:
        task = bar.add_task("preprocess", total=manifest.total_rows)
        for i, shard in enumerate(manifest.shards):
            for start in range(0, shard.rows, batch_size):
                rb = read_rows(manifest_dir, i, start, min(start + batch_size, shard.rows))
                dense, kjt = run(RawBatch.from_arrow(rb, manifest.dataset))
                rows += dense.shape[0]
                bar.update(task, advance=dense.shape[0])
    console.print(f"preprocessed {rows:,} rows with the {executor} executor at "
                  f"{rows / (time.perf_counter() - t):,.0f} rows/s "
                  f"({len(the_plan.dense_features())} dense, {len(the_plan.tables())} sparse features)")


def _context(run_key: str, config: Path | None, **overrides):
    return RunContext.create(run_key, _pipeline_config(config, overrides))


def _run_stages(ctx, names: list[str]):
    outputs = {}
    with _progress() as bar:
        task = bar.add_task("pipeline", total=len(names))
        for name in names:
            bar.update(task, description=name)
            outputs[name] = STAGE_FUNCTIONS[name](ctx)
            bar.advance(task)
    return outputs


def _missing_stages(ctx, upto: str) -> list[str]:
    needed = STAGES[: STAGES.index(upto) + 1]
    return [s for s in needed if s == upto or not (ctx.stage_dir(s) / "outputs.json").exists()]


@app.command()
def train(run_key: str = "cli", config: Path | None = None, workers: int | None = None,
          epochs: int | None = None, rows_per_day: int | None = None):
    """Train (running the data stages first where this run key has none)."""
    overrides = {"rows_per_day": rows_per_day}
    ctx = _context(run_key, config, **overrides)
    if workers is not None:
        ctx.config.resources.workers = workers
    if epochs is not None:
        ctx.config.train.epochs = epochs
    out = _run_stages(ctx, _missing_stages(ctx, "evaluate"))
    console.print_json(json.dumps({k: out[k].model_dump(mode="json") for k in ("train", "evaluate") if k in out}))


@app.command("compile")
def compile_cmd(run_key: str = "cli", config: Path | None = None):
    """Compile a trained run's model for inference and compare it with eager."""
    ctx = _context(run_key, config)
    out = _run_stages(ctx, _missing_stages(ctx, "compile"))
    console.print_json(out["compile"].report.model_dump_json())


@app.command()
def run(run_key: str = typer.Option(None, help="default: local__<timestamp>"), config: Path | None = None,
        rows_per_day: int | None = None):
    """Run the whole daily pipeline in this process, without Airflow."""
    ctx = _context(run_key or time.strftime("local__%Y%m%dT%H%M%S"), config, rows_per_day=rows_per_day)
    _run_stages(ctx, STAGES)
    _print_summary(summarize(ctx, _mlflow(ctx)))


@app.command()
def summary(run_key: str, as_json: bool = typer.Option(False, "--json", help="print the summary as JSON")):
    """What a pipeline run decided, did and measured, per system (a failed or running run: as far as it got)."""
    ctx = RunContext.create(run_key, PipelineConfig())
    if not ctx.run_dir.is_dir():
        raise typer.BadParameter(f"no pipeline run {ctx.run_key!r} under {ctx.run_dir.parent}", param_hint="RUN_KEY")
    data = summarize(ctx, _mlflow(ctx))
    if as_json:
        console.print_json(json.dumps(data, default=str))
    else:
        _print_summary(data)


@app.command()
def demo(rows_per_day: int = 200_000, workers: int = 2, epochs: int = 1):
    """Run the recforge_daily DAG once through Airflow on the embedded defaults, then print a summary."""
    summary_data = run_demo(rows_per_day=rows_per_day, workers=workers, epochs=epochs, console=console)
    _print_summary(summary_data)
    console.print(how_to_open())


@app.command("land-synthetic")
def land_synthetic(
    start: str = typer.Option(..., help="first day, YYYY-MM-DD"),
    days: int = typer.Option(2, min=1, help="number of consecutive days"),
    dir: Path = typer.Option(None, help="landing directory (default $RECFORGE_HOME/landing, make up's source_uri)"),
    rows_per_day: int = typer.Option(200_000, min=1), seed: int = 0, dataset: str = "criteo_kaggle",
):
    """Land synthetic days as DIR/day_{ds}.tsv.gz (temp + rename), what recforge_daily waits for by default."""
    from datetime import date  # lazy: only this command parses dates

    from recforge.pipelines.landing import land_synthetic as land  # lazy: fsspec; numpy when days are generated
    from recforge.settings import recforge_home  # lazy: only this command needs the home directory

    try:
        first = date.fromisoformat(start)
    except ValueError:
        raise typer.BadParameter(f"{start!r} is not a day (YYYY-MM-DD)", param_hint="--start") from None
    target = dir or recforge_home() / "landing"
    with console.status(f"landing {days} synthetic day(s) x {rows_per_day:,} rows in {target}"):
        files = land(target, first, days, rows_per_day=rows_per_day, seed=seed, dataset=dataset)
    for f in files:
        console.print(str(f))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context, name: str = typer.Argument(..., help="e.g. generator, embeddings, compile")):
    """Run bench/bench_NAME.py (extra arguments pass through); results go to bench/results/."""
    script = repo_root() / "bench" / f"bench_{name}.py"
    if not script.exists():
        available = sorted(p.stem.removeprefix("bench_") for p in (repo_root() / "bench").glob("bench_*.py"))
        raise typer.BadParameter(f"no benchmark {name!r}; available: {available}")
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args]))


def _mlflow(ctx: RunContext):
    """What the summary reads from the run's MLflow runs."""
    from recforge.ui.mlflow_view import MlflowView  # lazy: mlflow (seconds to import) only for a summary

    return MlflowView(ctx.tracking_uri, ctx.experiment)


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console)


RESULT_FORMATS = {
    "rows_ingested": "{:,}", "rows_quarantined": "{:,}", "train_samples_per_s": "{:,.0f} samples/s",
    "train_steps": "{:,}", "final_train_loss": "{:.4f}", "holdout_auc": "{:.4f}", "holdout_logloss": "{:.4f}",
    "holdout_ne": "{:.4f}", "auc_ceiling": "{:.4f}", "compile_speedup": "{:.2f}x", "train_wall_s": "{:.1f} s",
}
STATE_STYLE = {"complete": "green", "failed": "bold red", "running": "yellow", "incomplete": "dim"}
SYSTEM_STYLE = {"used": "green", "not used": "dim", "not yet": "dim", "not run": "red"}


def _print_summary(data: dict) -> None:
    """recforge.pipelines.summary.summarize's dict: the run's status, its results, then per system what it
    decided, did and measured (or why it did not run)."""
    status = data["status"]
    console.print(Text.assemble((f"recforge run {data['run_key']}: ", "bold"),
                                (status["text"], STATE_STYLE.get(status["state"], ""))))
    results = Table(title="results", show_header=False, title_justify="left")
    for key, value in data["results"].items():
        text = RESULT_FORMATS[key].format(value) if key in RESULT_FORMATS and value is not None else fmt(value)
        results.add_row(key.replace("_", " "), Text(text))
    if data["results"]:
        console.print(results)
    for sec in data["systems"].values():
        title = Text.assemble((sec["title"], "bold"), "  ", (sec["state"], SYSTEM_STYLE.get(sec["state"], "")))
        rows = [(part if i == 0 else "", label, value) for part in ("decided", "did", "measured")
                for i, (label, value) in enumerate(sec[part])]
        if not rows:  # nothing but the note (which says the state in words): one line
            console.print(Text.assemble((sec["title"], "bold"), ": ", (sec["note"] or sec["state"], "italic")))
            continue
        table = Table(title=title, show_header=False, title_justify="left", min_width=60,
                      caption=Text(sec["note"], style="italic") if sec["note"] else None, caption_justify="left")
        table.add_column(style="dim", width=9)
        table.add_column()
        table.add_column(overflow="fold")
        for part, label, value in rows:
            table.add_row(part, Text(str(label)), Text(fmt(value)))
        console.print(table)
    for problem in data.get("problems") or []:
        console.print(Text.assemble(("note: ", "yellow"), problem))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
