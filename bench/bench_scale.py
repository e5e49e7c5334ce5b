"""The daily pipeline at scale (`recforge bench scale`): wall time per stage and peak RSS per process vs rows per day.

Each size runs the whole daily pipeline on the in-process runner `recforge run` uses (recforge.pipelines.runner:
generate a synthetic day and its held-out next day -> ingest (+ column statistics) -> plan_resources -> train
(elastic, `--workers` ranks under the job master) -> evaluate -> compile (RECom) -> publish), not Airflow, in a
fresh child process with its own $RECFORGE_HOME (a fresh MLflow store: no champion to score). The child resets its
own peak RSS (VmHWM, via /proc/self/clear_refs) at each stage and reads it at the stage's end; a sampler in this
process reads RSS and VmHWM of every process in the child's tree every `--interval` s (torchrun, the training
ranks, RAP's profiling ranks, anything else) and attributes each to the stage it appeared in. The job master is a
thread of the child (recforge.elastic.job), counted in `main`.

Goal (issue 17, deliverable 6): time linear in rows (seconds per million rows per stage, and the slope of a
least-squares line time = a + b * rows), memory flat (peak RSS slope in MB per million rows ~ 0). Sizes the
machine cannot hold (disk for the raw days, their Parquet and the run's artifacts; memory) are refused before
anything runs, naming the limit; larger sizes whose time, predicted from the smaller sizes of the same run, is
beyond `--budget-min` are skipped with the estimate.

    python bench/bench_scale.py --rows 100000,300000        # development: ~5 min on a quiet 2-core machine
    python bench/bench_scale.py --rows 100000,1000000,10000000 --budget-min 25
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform as py_platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model, write_report  # noqa: E402  # bench/_results.py

RESULTS = Path(__file__).resolve().parent / "results"
REPORT = RESULTS / "bench_scale.json"
PLOT = RESULTS / "bench_scale.png"
# the stages in the order they run; "stats" (column statistics, recforge.pipelines.hooks.data_stats) runs inside
# the ingest stage and is timed apart from it
STAGES = ["generate", "ingest", "stats", "plan_resources", "train", "evaluate", "compile", "publish"]
# bytes per row per day on disk, measured on the criteo_kaggle schema (bench runs of 0.1M-1M rows): the raw TSV
# (~190), its Parquet shards (~110), the run's copies and artifacts; x 2 days (the run day and its held-out day)
DISK_BYTES_PER_ROW = 2 * 330
DISK_FIXED = 2 * 1024**3  # MLflow store, checkpoints, models, compiled artifact, logs
DISK_HEADROOM = 0.9  # refuse beyond this share of the free disk
# peak RSS of the whole process tree that does not depend on rows (main with torch and MLflow, torchrun, the
# ranks with their embedding tables at table_cap 100k, RAP's profiling ranks): measured, rounded up
MEM_FIXED = 6 * 1024**3
# what a stage still holds per row of a day: the train stage's ledger audit (recforge.train.loop.ledger.audit, one
# Counter key per row) measured +230 MB per million rows in main (0.1M vs 1M); 0 once every stage streams
MEM_BYTES_PER_ROW = 240
MEM_HEADROOM = 0.8  # refuse beyond this share of the available memory
DEFAULT_TIMEOUT_S = 3 * 3600.0


class Refused(ValueError):
    """A size the machine cannot hold: the message names the limit."""


# ---- what the machine holds ---------------------------------------------------------------------------------------
def estimate(rows: int) -> dict[str, float]:
    """Disk and memory a run of `rows` rows per day needs (bytes)."""
    return {"disk_bytes": DISK_FIXED + DISK_BYTES_PER_ROW * rows, "memory_bytes": MEM_FIXED + MEM_BYTES_PER_ROW * rows}


def check_fits(rows: int, work: Path, *, free_disk: int | None = None, available_memory: int | None = None) -> dict:
    """The estimate for `rows`; Refused (naming the limit) when the disk under `work` or the memory cannot hold it."""
    if rows < 1000:
        raise Refused(f"rows per day must be >= 1000 (the held-out split and the champion gate need rows), "
                      f"got {rows}")
    need = estimate(rows)
    probe = work if work.exists() else next(p for p in work.parents if p.exists())
    disk = shutil.disk_usage(probe).free if free_disk is None else free_disk
    mem = psutil.virtual_memory().available if available_memory is None else available_memory
    if need["disk_bytes"] > DISK_HEADROOM * disk:
        raise Refused(f"{rows:,} rows per day need ~{need['disk_bytes'] / 1e9:.1f} GB of disk (2 days of raw TSV "
                      f"+ Parquet + artifacts, {DISK_BYTES_PER_ROW} B/row + {DISK_FIXED / 1e9:.0f} GB) but {probe} "
                      f"has {disk / 1e9:.1f} GB free (limit {DISK_HEADROOM:.0%} of it)")
    if need["memory_bytes"] > MEM_HEADROOM * mem:
        raise Refused(f"{rows:,} rows per day need ~{need['memory_bytes'] / 1e9:.1f} GB of memory (peak RSS of the "
                      f"process tree) but {mem / 1e9:.1f} GB is available (psutil.virtual_memory; limit "
                      f"{MEM_HEADROOM:.0%} of it)")
    return {**need, "free_disk_bytes": disk, "available_memory_bytes": mem}


# ---- the linear fit -----------------------------------------------------------------------------------------------
def linear_fit(rows: list[int], values: list[float]) -> dict[str, float | None]:
    """Least squares value = intercept + slope * rows; slope per million rows, r2 (None with < 2 sizes)."""
    x = np.asarray(rows, dtype=np.float64) / 1e6
    y = np.asarray(values, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        return {"slope_per_mrow": None, "intercept": float(y[0]) if y.size else None, "r2": None}
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
    return {"slope_per_mrow": float(slope), "intercept": float(intercept), "r2": r2}


# ---- the RSS sampler ----------------------------------------------------------------------------------------------
def _status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (kB) of `pid` from /proc/<pid>/status ({} when it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def classify(cmdline: list[str], is_root: bool) -> str:
    """The role of a process of the pipeline's tree, from its command line."""
    if is_root:
        return "main"
    text = " ".join(cmdline)
    if "torch.distributed.run" in text:
        return "torchrun"
    if "recforge.rap.profiling" in text:
        return "rap_profile_rank"
    if "recforge.worker" in text:
        return "train_rank"
    if "recforge.elastic.master" in text:
        return "job_master"
    if "compile_worker" in text:
        return "inductor_compile_worker"
    if "multiprocessing" in text:
        return "multiprocessing_child"
    name = Path(cmdline[0]).name if cmdline else "?"
    if name in ("cc1plus", "cc1", "as", "ld", "collect2", "g++", "gcc", "c++"):
        return "c++_toolchain"
    return f"other:{name}"


@dataclass
class ProcSeen:
    pid: int
    role: str
    first_t: float
    last_t: float
    peak_rss_kb: int = 0
    hwm_kb: int = 0
    cmd: str = ""


@dataclass
class RssSampler:
    """Samples the RSS and VmHWM of a process and all its descendants every `interval_s` seconds (a thread)."""

    root: int
    interval_s: float = 0.5
    procs: dict[tuple[int, float], ProcSeen] = field(default_factory=dict)
    tree_samples: list[tuple[float, int]] = field(default_factory=list)  # (t, summed RSS kB of the tree)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        now = time.time()
        try:
            root = psutil.Process(self.root)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total = 0
        for p in tree:
            kb = _status_kb(p.pid)
            if not kb.get("VmRSS"):  # gone, a zombie, or a kernel thread
                continue
            try:
                key = (p.pid, p.create_time())
                seen = self.procs.get(key)
                if seen is None:
                    cmd = p.cmdline()
                    role = classify(cmd, p.pid == self.root)
                    if p.pid != self.root and cmd and cmd == self._root_cmd():
                        role = "main_fork"  # a fork of main before its exec (pages shared with main)
                    seen = ProcSeen(p.pid, role, now, now, cmd=" ".join(cmd)[:160])
                    self.procs[key] = seen
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            seen.last_t = now
            seen.peak_rss_kb = max(seen.peak_rss_kb, kb.get("VmRSS", 0))
            seen.hwm_kb = max(seen.hwm_kb, kb.get("VmHWM", 0)) if seen.role != "main" else 0  # main: per stage
            total += kb.get("VmRSS", 0)
        self.tree_samples.append((now, total))

    def _root_cmd(self) -> list[str]:
        if not hasattr(self, "_root_cmdline"):
            try:
                self._root_cmdline = psutil.Process(self.root).cmdline()
            except psutil.Error:
                return []
        return self._root_cmdline

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as e:  # a sampling bug must not stop sampling: counted in the report
                self.errors.append(f"{type(e).__name__}: {e}")

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * self.interval_s + 5)

    def by_role(self) -> dict[str, dict[str, Any]]:
        """Per role: processes seen, the largest peak (max of sampled RSS and VmHWM) of one of them, in MB."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.procs.values():
            r = out.setdefault(p.role, {"processes": 0, "peak_rss_mb": 0.0, "largest": ""})
            r["processes"] += 1
            mb = max(p.peak_rss_kb, p.hwm_kb) / 1024
            if mb >= r["peak_rss_mb"]:
                r["peak_rss_mb"], r["largest"] = mb, p.cmd
        return out


# ---- the child: one pipeline run ----------------------------------------------------------------------------------
def _reset_hwm() -> None:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0), so the next read is this stage's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm_kb() -> int:
    return _status_kb(os.getpid()).get("VmHWM", 0)


def pipeline_config(rows: int, workers: int, epochs: int) -> dict[str, Any]:
    """The daily pipeline's defaults (as the DAG runs them) at `rows` rows per day; training as configured."""
    return {"rows_per_day": rows, "train": {"epochs": epochs}, "resources": {"workers": workers}}


def drive(rows: int, home: Path, events: Path, workers: int, epochs: int) -> None:
    """Run every stage in this process (the runner's order), appending one JSON line per stage to `events`."""
    home.mkdir(parents=True, exist_ok=True)
    os.environ["RECFORGE_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    os.environ["RECFORGE_MLFLOW_ARTIFACTS"] = str(home / "mlflow" / "artifacts")
    import recforge.pipelines.hooks.data_stats as data_stats  # lazy: after $RECFORGE_HOME is set
    from recforge.pipelines.context import RunContext  # lazy: as above
    from recforge.pipelines.runner import STAGE_FUNCTIONS  # lazy: as above
    from recforge.pipelines.runner import STAGES as RUN_STAGES  # lazy: as above

    def emit(doc: dict[str, Any]) -> None:
        with open(events, "a") as f:
            f.write(json.dumps(doc) + "\n")

    inner = data_stats.record_data_stats

    def timed_stats(*args: Any, **kw: Any) -> Any:  # the statistics pass inside ingest, timed and peaked apart
        emit({"event": "hwm", "stage": "ingest", "hwm_kb": _hwm_kb()})
        _reset_hwm()
        t0 = time.time()
        try:
            return inner(*args, **kw)
        finally:
            emit({"event": "stage", "stage": "stats", "start": t0, "end": time.time(), "hwm_kb": _hwm_kb()})
            _reset_hwm()

    data_stats.record_data_stats = timed_stats
    ctx = RunContext.create(f"scale_{rows}", pipeline_config(rows, workers, epochs), home=home)
    emit({"event": "config", "config": ctx.config.model_dump(mode="json"), "pid": os.getpid()})
    for name in RUN_STAGES:
        _reset_hwm()
        t0 = time.time()
        emit({"event": "start", "stage": name, "start": t0, "rss_kb": _status_kb(os.getpid()).get("VmRSS", 0)})
        out = STAGE_FUNCTIONS[name](ctx)
        emit({"event": "stage", "stage": name, "start": t0, "end": time.time(), "hwm_kb": _hwm_kb(),
              "outputs": _summary(name, out)})


def _summary(name: str, out: Any) -> dict[str, Any]:
    """The few output fields the report keeps per stage."""
    keep = {"ingest": ("rows_ingested", "rows_quarantined"), "train": ("samples_per_s", "steps", "wall_s",
                                                                       "world_size", "samples_trained"),
            "evaluate": ("auc", "logloss", "rows", "auc_ceiling"), "publish": ("version", "promoted")}
    doc = out.model_dump(mode="json")
    summary = {k: doc.get(k) for k in keep.get(name, ())}
    if name == "plan_resources":
        summary["preprocessing"] = (doc.get("preprocessing") or {}).get("mode")
    return summary


# ---- the parent: one size, sampled ---------------------------------------------------------------------------------
def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return out


def stage_table(events: list[dict[str, Any]], procs: list[ProcSeen], rows: int) -> dict[str, dict[str, Any]]:
    """Per stage: seconds (ingest without its statistics pass), s per million rows, main's peak RSS and the peak of
    each child role first seen during the stage (MB)."""
    done = {e["stage"]: e for e in events if e.get("event") == "stage"}
    started = {e["stage"]: e for e in events if e.get("event") == "start"}
    ingest_hwm = max((e["hwm_kb"] for e in events if e.get("event") == "hwm"), default=0)
    table: dict[str, dict[str, Any]] = {}
    for name in STAGES:
        e = done.get(name)
        if e is None:
            continue
        seconds = e["end"] - e["start"]
        main_kb = e["hwm_kb"]
        if name == "ingest" and "stats" in done:
            seconds -= done["stats"]["end"] - done["stats"]["start"]
            main_kb = max(main_kb, ingest_hwm)
        roles: dict[str, float] = {"main": main_kb / 1024}
        for p in procs:
            if p.role != "main" and e["start"] <= p.first_t <= e["end"]:
                roles[p.role] = max(roles.get(p.role, 0.0), max(p.peak_rss_kb, p.hwm_kb) / 1024)
        carried_kb = started.get(name, {}).get("rss_kb")
        table[name] = {"seconds": seconds, "s_per_mrow": seconds / (rows / 1e6), "peak_rss_mb": roles,
                       "main_start_rss_mb": None if carried_kb is None else carried_kb / 1024,
                       "main_growth_mb": None if carried_kb is None else (main_kb - carried_kb) / 1024,
                       "outputs": e.get("outputs", {})}
    return table


def run_size(rows: int, work: Path, *, workers: int, epochs: int, interval_s: float, timeout_s: float,
             keep: bool, progress: Any = None) -> dict[str, Any]:
    """One pipeline run at `rows` rows per day in a child process, sampled; its stage table and process peaks."""
    home = work / f"rows_{rows}"
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    events = home / "events.jsonl"
    log = home / "driver.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--drive", str(rows), "--home", str(home / "home"),
           "--events", str(events), "--workers", str(workers), "--epochs", str(epochs)]
    t0 = time.time()
    task = progress.add_task(f"{rows:,} rows", total=len(STAGES) - 1) if progress is not None else None
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        with RssSampler(proc.pid, interval_s) as sampler:
            while proc.poll() is None:
                if time.time() - t0 > timeout_s:
                    proc.terminate()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=60)
                    raise TimeoutError(f"the pipeline at {rows:,} rows did not finish within {timeout_s:.0f}s; "
                                       f"see {log}")
                if progress is not None:
                    ev = _read_events(events)
                    n = sum(1 for e in ev if e.get("event") == "stage" and e["stage"] != "stats")
                    current = next((e["stage"] for e in reversed(ev) if e.get("event") == "start"), "starting")
                    progress.update(task, completed=n, description=f"{rows:,} rows: {current}")
                time.sleep(min(1.0, interval_s))
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"the pipeline at {rows:,} rows failed (exit {proc.returncode}); see {log}:\n{tail}")
    ev = _read_events(events)
    procs = list(sampler.procs.values())
    result = {
        "rows_per_day": rows, "wall_s": wall, "stages": stage_table(ev, procs, rows),
        "peak_rss_mb_by_role": sampler.by_role(),
        "peak_tree_rss_mb": max((kb for _, kb in sampler.tree_samples), default=0) / 1024,
        "samples": len(sampler.tree_samples), "sampler_errors": sampler.errors[:5],
        "config": next((e["config"] for e in ev if e.get("event") == "config"), None),
    }
    if not keep:
        shutil.rmtree(home / "home", ignore_errors=True)
    return result


# ---- the report ---------------------------------------------------------------------------------------------------
def fits(sizes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stage: the time fit (s per million rows), the peak RSS fit (MB per million rows) of each role, and the fit
    of main's growth within the stage (its peak less the RSS it carried in from the stages before)."""
    out: dict[str, dict[str, Any]] = {}
    rows = [s["rows_per_day"] for s in sizes]
    for name in STAGES:
        have = [s for s in sizes if name in s["stages"]]
        if not have:
            continue
        xs = [s["rows_per_day"] for s in have]
        roles = sorted({r for s in have for r in s["stages"][name]["peak_rss_mb"]})
        out[name] = {"time": linear_fit(xs, [s["stages"][name]["seconds"] for s in have]),
                     "peak_rss_mb": {r: linear_fit([s["rows_per_day"] for s in have if r in s["stages"][name][
                         "peak_rss_mb"]], [s["stages"][name]["peak_rss_mb"][r] for s in have
                                           if r in s["stages"][name]["peak_rss_mb"]]) for r in roles}}
        grown = [s for s in have if s["stages"][name].get("main_growth_mb") is not None]
        if grown:  # main's peak less the RSS it carried into the stage: what the stage itself held
            out[name]["main_growth_mb"] = linear_fit([s["rows_per_day"] for s in grown],
                                                     [s["stages"][name]["main_growth_mb"] for s in grown])
    out["total"] = {"time": linear_fit(rows, [s["wall_s"] for s in sizes]),
                    "peak_tree_rss_mb": linear_fit(rows, [s["peak_tree_rss_mb"] for s in sizes])}
    return out


def plot(sizes: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # lazy: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    for name in STAGES:
        have = [s for s in sizes if name in s["stages"]]
        if not have:
            continue
        x = [s["rows_per_day"] for s in have]
        ax_t.plot(x, [s["stages"][name]["seconds"] for s in have], "o-", label=name)
        ax_m.plot(x, [max(s["stages"][name]["peak_rss_mb"].values()) for s in have], "o-", label=name)
    ax_m.plot([s["rows_per_day"] for s in sizes], [s["peak_tree_rss_mb"] for s in sizes], "k--",
              label="whole tree (sum)")
    ax_t.set(xscale="log", yscale="log", xlabel="rows per day", ylabel="wall time (s)",
             title="time per stage (linear = slope 1)")
    ax_m.set(xscale="log", xlabel="rows per day", ylabel="peak RSS of one process (MB)",
             title="peak RSS per stage (largest process of the stage)")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def predicted_seconds(sizes: list[dict[str, Any]], rows: int) -> float | None:
    """The whole run's wall time at `rows`, from the sizes measured so far (linear; None with < 2 sizes)."""
    if len(sizes) < 2:
        return None
    f = linear_fit([s["rows_per_day"] for s in sizes], [s["wall_s"] for s in sizes])
    slope, intercept = f["slope_per_mrow"], f["intercept"]
    return None if slope is None or intercept is None else float(intercept + slope * rows / 1e6)


def _parse_rows(text: str) -> list[int]:
    try:
        rows = sorted({int(float(t)) for t in text.split(",") if t.strip()})
    except ValueError:
        raise SystemExit(f"--rows: expected comma-separated row counts (e.g. 100000,1000000), got {text!r}") from None
    if not rows:
        raise SystemExit("--rows: no sizes given")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="100000,1000000,10000000", help="rows per day, comma-separated")
    ap.add_argument("--workers", type=int, default=2, help="training ranks")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.5, help="RSS sampling period (s)")
    ap.add_argument("--budget-min", type=float, default=25.0,
                    help="skip a size whose predicted wall time (from the smaller ones) is beyond this")
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="per size")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep each size's $RECFORGE_HOME")
    ap.add_argument("--out", type=Path, default=REPORT)
    ap.add_argument("--add-to", type=Path, default=None,
                    help="an earlier report of this bench (same --workers/--epochs): its sizes not run now are kept "
                         "(each with the command that measured it) and fitted together with the new ones")
    ap.add_argument("--drive", type=int, default=None, help=argparse.SUPPRESS)  # the child: one pipeline run
    ap.add_argument("--home", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--events", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drive is not None:
        drive(args.drive, args.home, args.events, args.workers, args.epochs)
        return 0
    if args.workers > (os.cpu_count() or 1):
        raise SystemExit(f"--workers {args.workers} is more than this machine's {os.cpu_count()} cores "
                         "(os.cpu_count())")
    rows = _parse_rows(args.rows)
    earlier = json.loads(args.add_to.read_text()) if args.add_to is not None else None
    if earlier is not None and (earlier.get("training", {}).get("workers") != args.workers
                                or earlier.get("training", {}).get("epochs") != args.epochs):
        raise SystemExit(f"--add-to {args.add_to}: measured with training {earlier.get('training')}, not "
                         f"--workers {args.workers} --epochs {args.epochs}")
    work = args.work or Path(tempfile.mkdtemp(prefix="recforge-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        checks = {r: check_fits(r, work) for r in rows}  # every size, before anything runs
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # lazy: the parent only

    report: dict[str, Any] = {
        "benchmark": "scale", "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": py_platform.python_version(),
                    "memory_gb": psutil.virtual_memory().total / 1e9},
        "loadavg_before": os.getloadavg(), "threads": {"main": 1, "per_rank": 1, "ranks": args.workers},
        "training": {"epochs": args.epochs, "workers": args.workers, "note": "the pipeline's defaults otherwise "
                     "(batch 512 per rank, preprocessing auto, checkpoints per CheckpointConfig)"},
        "sampling_interval_s": args.interval, "estimates": {str(r): c for r, c in checks.items()},
        "sizes": [], "skipped": [],
    }
    if earlier is not None:
        report["sizes"] = [{"command": earlier.get("command"), **s} for s in earlier.get("sizes", [])
                           if s["rows_per_day"] not in rows]
        report["added_to"] = str(args.add_to)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} stages"),
                  TimeElapsedColumn()) as progress:
        for r in rows:
            guess = predicted_seconds(report["sizes"], r)
            if guess is not None and guess > args.budget_min * 60:
                report["skipped"].append({"rows_per_day": r, "predicted_s": guess,
                                          "reason": f"predicted {guess / 60:.0f} min > --budget-min "
                                                    f"{args.budget_min:g}"})
                progress.console.print(f"skipping {r:,} rows: predicted {guess / 60:.0f} min "
                                       f"> --budget-min {args.budget_min:g}")
                continue
            load = os.getloadavg()
            size = run_size(r, work, workers=args.workers, epochs=args.epochs, interval_s=args.interval,
                            timeout_s=args.timeout_s, keep=args.keep, progress=progress)
            size["loadavg_before"], size["loadavg_after"] = load, os.getloadavg()
            size["predicted_s"], size["command"] = guess, report["command"]
            report["sizes"].append(size)
            report["sizes"].sort(key=lambda x: x["rows_per_day"])
            report["fits"] = fits(report["sizes"])
            write_report(args.out, report)  # after every size: a later failure keeps the earlier ones
    report["loadavg_after"] = os.getloadavg()
    report["fits"] = fits(report["sizes"])
    write_report(args.out, report)
    if report["sizes"]:
        plot(report["sizes"], args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
    _print_table(report)
    if args.work is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0



def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console  # lazy: the parent only
    from rich.table import Table  # lazy: as above

    sizes = report["sizes"]
    table = Table(title="daily pipeline at scale: seconds (s per M rows) / peak RSS MB of the largest process")
    table.add_column("stage")
    for s in sizes:
        table.add_column(f"{s['rows_per_day']:,}", justify="right")
    table.add_column("slope s/Mrow", justify="right")
    table.add_column("RSS slope MB/Mrow", justify="right")
    table.add_column("main's growth in stage MB", justify="right")
    for name in STAGES:
        if not any(name in s["stages"] for s in sizes):
            continue
        cells = []
        for s in sizes:
            st = s["stages"].get(name)
            cells.append("-" if st is None else
                         f"{st['seconds']:.1f} ({st['s_per_mrow']:.0f}) / {max(st['peak_rss_mb'].values()):.0f}")
        f = report["fits"][name]
        slope = f["time"]["slope_per_mrow"]
        rss = [v["slope_per_mrow"] for v in f["peak_rss_mb"].values() if v["slope_per_mrow"] is not None]
        growth = [s["stages"][name].get("main_growth_mb") for s in sizes if name in s["stages"]]
        table.add_row(name, *cells, "-" if slope is None else f"{slope:.1f}",
                      "-" if not rss else f"{max(rss, key=abs):.1f}",
                      " / ".join("-" if g is None else f"{g:.0f}" for g in growth))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
