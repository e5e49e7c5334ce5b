"""RAP where preprocessing matters: co-run against ideal and inline as the preprocessing share of a step grows
(`recforge bench rap_share`).

bench/bench_rap.py measures co-running where preprocessing is ~1-5% of a step, where it cannot matter. Here the
points are chosen by their measured share:

1. calibrate: for every candidate (RAP plan x model size x batch), the fused executor's time for one batch alone
   (its single pass where it can, the trainer's thread budget) p and the median step time of the candidate's
   model on ready batches (the "ideal" step) t: the preprocessing share of a step with inline preprocessing is
   p / (t + p). It bounds what co-running can gain: co-run / inline <= (t + p) / t = 1 / (1 - share), so the goal
   of 1.3x needs a share of at least 23%;
2. choose: for each target share (default 3%, 25%, 50%) the candidate whose measured share is closest to it
   (in log space; no candidate used twice);
3. per chosen point: RAP's profile-based prediction (the stage profiler on the point's own model and batches,
   RAP's scheduler over the profile and the timed fused kernels, the simulator's iteration time: predicted ideal,
   inline, co-run and the share of the kernels hidden) and the measurement: ideal / inline / corun over the real
   trainer (bench_rap.run_epoch: train_epoch over TaskBatches / CorunTaskBatches), in interleaved rounds, medians.
   The ratios compare steady-state steps (every step but each epoch's first, whose batch a co-run preprocesses
   with nothing to hide behind: the pipeline's fill, nothing over a real epoch's thousands of steps); each epoch's
   wall / steps, the fill included, is reported beside them (`epoch_*`).

Fixed threads: the trainer `--threads` (1), the co-run thread `--corun-threads` (1): 2 cores. A configuration the
machine cannot hold (cores, memory) is refused before anything runs.

    python bench/bench_rap_share.py                         # 3 targets, 5 rounds of 6 steps
    python bench/bench_rap_share.py --targets 0.03,0.25,0.5 --rounds 5 --steps 6
    python bench/bench_rap_share.py --calibrate-only        # the candidates' shares, nothing else

Writes bench/results/bench_rap_share.json and bench/results/rap_share.png (co-run / ideal and co-run / inline
against the share, measured and predicted; `--out X/bench_NAME.json` writes X/NAME.png).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import psutil
import torch
import torch.distributed as dist

from _results import cpu_model, write_report  # bench/_results.py (bench/ is the script's directory)
from bench_rap import RowsInMemory, make_data, preprocess_ms, run_epoch
from recforge.config import ModelConfig, TrainConfig
from recforge.data.shards import read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.fused_torch_script import ScriptedFusedExecutor
from recforge.preprocess.presets import load_plan, preset_dataset
from recforge.preprocess.synth import random_raw_batch
from recforge.rap.planning.job_schedule import plan_schedule
from recforge.rap.planning.schedule import whole_kernel_schedule
from recforge.rap.planning.simulator import corun_thread_iteration_ms
from recforge.rap.profiling.kernel_timer import batch_ms
from recforge.rap.profiling.profile_job import proxy_units
from recforge.rap.profiling.profiler import BackgroundRunner, ProfileKey, ProxyKernel, StageProfiler
from recforge.rap.profiling.stages import STAGES, StageTracker
from recforge.train.loop.batches import prepare
from recforge.train.loop.loss import step_loss
from recforge.train.loop.step_loop import PhaseTimes
from recforge.train.model import build_dlrm
from recforge.train.sharding import shard_model

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("ideal", "inline", "corun", "corun_early")
# corun: the schedule RAP's scheduler makes over the point's stage profile (what the pipeline runs);
# corun_early: every fused group whole at the first stage boundary (emb_fwd), run as one executor call (the
# single pass where the form has it): the co-run thread gets the whole step

# model sizes: (dense arch hidden layers, over arch hidden layers, embedding dim, table cap)
MODELS: dict[str, tuple[list[int], list[int], int, int]] = {
    "base": ([256], [256, 128], 16, 20_000),  # bench_rap's default
    "small": ([64], [64, 32], 16, 10_000),
    "tiny": ([16], [16], 8, 2_000),
    "micro": ([8], [8], 4, 500),
}
# the fused executor's form, for inline preprocessing and the co-run alike: "single" = one pass over every feature's
# chain per row tile (recforge's CPU form), "grouped" = one C++ call per fused group (RAP's horizontal fusion), the
# whole batch as one traced TorchScript graph (the executor's default: no GIL between groups), "grouped_python" = the
# same calls made from Python group by group (the GIL taken between them), "torch" = the same groups on the ops' torch
# fallback (one torch kernel per op: the unfused baseline, FusedExecutor(native=False)), where preprocessing is a
# larger share of a step; "script" = the same torch ops, each group one TorchScript function
# (recforge.preprocess.fused_torch_script: still one kernel per op, but the interpreter runs without the GIL)
FORMS = ("single", "grouped", "grouped_python", "torch", "script")


def executor_options(form: str) -> dict[str, bool]:
    """FusedExecutor options of an executor form (FORMS); "script" shares the torch form's (its executor class is
    ScriptedFusedExecutor: build_executor)."""
    if form not in FORMS:
        raise ValueError(f"unknown executor form {form!r}; choose from {list(FORMS)}")
    return {"single_pass": form == "single", "native": form not in ("torch", "script"),
            "trace_batches": form != "grouped_python"}


def build_executor(form: str, plan, ds, compiled=None) -> FusedExecutor:
    """The fused executor of an executor form (FORMS) for `plan`, sharing `compiled` when given."""
    if form == "script":
        executor_options(form)  # the name check
        return ScriptedFusedExecutor(plan, ds, compiled=compiled)
    return cast(FusedExecutor, make_executor("fused", plan, ds, compiled=compiled, **executor_options(form)))


@dataclass(frozen=True)
class Candidate:
    plan: str
    model: str
    batch: int
    form: str = "single"

    @property
    def name(self) -> str:
        return f"{self.plan}/{self.model}/b{self.batch}/{self.form}"


def parse_candidates(plans: str, models: str, batches: str, forms: str = "single") -> list[Candidate]:
    """Every plan x model x batch x executor form; unknown names and non-positive batches are refused, named."""
    ms = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in ms if m not in MODELS]
    if unknown:
        raise ValueError(f"--models: unknown model size(s) {unknown}; choose from {sorted(MODELS)}")
    fs = [f.strip() for f in forms.split(",") if f.strip()]
    if not fs or any(f not in FORMS for f in fs):
        raise ValueError(f"--forms: {forms!r}; choose from {list(FORMS)}")
    bs = [int(b) for b in batches.split(",") if b.strip()]
    if not bs or min(bs) < 1:
        raise ValueError(f"--batches: need positive batch sizes, got {batches!r}")
    return [Candidate(p.strip(), m, b, f) for p in plans.split(",") if p.strip() for m in ms for b in bs
            for f in fs]


def choose_points(shares: dict[Candidate, float], targets: list[float]) -> list[tuple[float, Candidate]]:
    """For each target share (in order), the unused candidate whose measured share is closest to it in log space;
    (target, candidate) pairs. Fewer candidates than targets: the last targets go without."""
    if any(not 0 < t < 1 for t in targets):
        raise ValueError(f"target shares must be in (0, 1), got {targets}")
    left = {c: s for c, s in shares.items() if s > 0}
    out = []
    for t in targets:
        if not left:
            break
        best = min(left, key=lambda c: (abs(math.log(left[c] / t)), c.name))
        out.append((t, best))
        del left[best]
    return out


def model_config(model: str) -> ModelConfig:
    dense, over, dim, _ = MODELS[model]
    return ModelConfig(arch="dlrm_dcn", embedding_dim=dim, dense_arch=[*dense, dim], over_arch=[*over, 1])


def memory_bytes(c: Candidate, rows_per_round: int) -> int:
    """Rough peak of one point: tables (weights, optimizer state, gradients: x3), the raw rows held in memory and
    their prepared copies (x3, 8 bytes a value), the profiler's proxy (at most 256 MiB)."""
    ds = preset_dataset(c.plan)
    plan = load_plan(c.plan, ds, MODELS[c.model][3])
    dim = MODELS[c.model][2]
    tables = sum(rows for _, rows in plan.tables()) * dim * 4 * 3
    cols = len(ds.columns)
    return tables + rows_per_round * cols * 8 * 3 + (256 << 20)


def check_machine(candidates: list[Candidate], threads: int, corun_threads: int, rows_per_round: int) -> None:
    """SystemExit, before anything runs, for what this machine cannot hold: more threads than cores (the co-run
    thread needs its own core, or it only time-slices with the trainer) or a point beyond the available memory."""
    cores = os.cpu_count() or 1
    if threads + corun_threads > cores:
        raise SystemExit(f"refused: trainer threads {threads} + co-run threads {corun_threads} > os.cpu_count() "
                         f"= {cores} cores; co-running needs a core of its own")
    avail = psutil.virtual_memory().available
    for c in candidates:
        need = memory_bytes(c, rows_per_round)
        if need > 0.8 * avail:
            raise SystemExit(f"refused: {c.name} needs about {need / 2**30:.2f} GiB, more than 80% of the "
                             f"{avail / 2**30:.2f} GiB available (psutil.virtual_memory().available)")


# ------------------------------------------------------------------ model and steps


class Point:
    """One candidate's plan, executor, model factory and ready batches (synthetic rows)."""

    def __init__(self, c: Candidate, seed: int) -> None:
        self.c = c
        self.ds = preset_dataset(c.plan)
        self.plan = load_plan(c.plan, self.ds, MODELS[c.model][3])
        self.executor = build_executor(c.form, self.plan, self.ds)
        self.model_cfg = model_config(c.model)
        torch.manual_seed(seed)
        init = build_dlrm(self.model_cfg, self.plan.tables(), len(self.plan.dense_features()))
        self.state = {k: v.clone() for k, v in init.state_dict().items()}
        cpu = torch.device("cpu")
        self.batches = [prepare(random_raw_batch(self.ds, c.batch, seed=seed + i), c.batch, self.executor, cpu)
                        for i in range(2)]

    def fresh(self):
        m = build_dlrm(self.model_cfg, self.plan.tables(), len(self.plan.dense_features()))
        m.load_state_dict(self.state)
        return shard_model(m, TrainConfig(batch_size=self.c.batch, sharding="table_wise"), world_size=1,
                           device=torch.device("cpu"))

    def stepper(self, sharded, tracker: StageTracker | None = None):
        net, opt, served = sharded.model, sharded.optimizer, [0]
        net.train()

        def step() -> None:
            b = self.batches[served[0] % len(self.batches)]
            served[0] += 1
            loss, _ = step_loss(net(b.dense, b.sparse), b.labels, b.weights, float(self.c.batch), 1)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if tracker is not None:
                tracker.step_end()

        return step


def step_ms(point: Point, sharded, warm: int = 1, reps: int = 3) -> float:
    step = point.stepper(sharded)
    for _ in range(warm):
        step()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def calibrate(c: Candidate, seed: int) -> dict[str, Any]:
    point = Point(c, seed)
    train = step_ms(point, point.fresh())
    prep = preprocess_ms(point.executor, point.ds, c.batch, reps=3)
    return {"candidate": asdict(c), "name": c.name, "ideal_step_ms": train, "preprocess_ms": prep,
            "share": prep / (train + prep), "prep_over_ideal": prep / train,
            "executor_path": point.executor.last_path, "torchscript_share": torchscript_share(point)}


def torchscript_share(point: Point, reps: int = 5) -> float | None:
    """The script and grouped forms: the share of a batch's wall time spent inside TorchScript calls, where the GIL is
    released (the rest, check_batch / the KJT's wrapper / the Python between groups, holds it); None for forms that
    trace nothing. A ratio of one thread's own times, so the machine's load moves it little (a spin thread's progress
    does not separate the forms under load: the GIL-hungry side is the one that waits)."""
    ex = point.executor
    if isinstance(ex, ScriptedFusedExecutor):
        def inside() -> float:
            return ex.script_s
    elif ex.traces is not None and point.c.form == "grouped":
        traces = ex.traces

        def inside() -> float:
            return traces.seconds
    else:
        return None
    raw = random_raw_batch(point.ds, point.c.batch, seed=1)
    ex(raw)
    ex(raw)  # the grouped form traces a batch shape the second time it is seen
    shares = []
    for _ in range(reps):
        before, t0 = inside(), time.perf_counter()
        ex(raw)
        shares.append((inside() - before) / (time.perf_counter() - t0))
    return round(statistics.median(shares), 4)


def predict(point: Point, threads: int, corun_threads: int, steps_per_point: int, threshold: float
            ) -> tuple[Any, dict[str, Any]]:
    """RAP's profile-based prediction for the point: its stage profile (the stage profiler on a fresh copy of the
    model over the point's batches, the proxy on a co-run thread), the schedule RAP's scheduler makes over it with
    the fused kernels timed at the co-run thread's budget, and the simulator's iteration times."""
    sharded = point.fresh()
    tracker = StageTracker(sharded.model)
    step = point.stepper(sharded, tracker)
    runner = BackgroundRunner(corun_threads)
    t0 = time.perf_counter()
    try:
        for _ in range(2):
            step()
        longest = max(statistics.median(t.ms[s] for t in tracker.steps) for s in STAGES)
        unit_ms = ProxyKernel(point.c.batch, max_units=1).standalone_ms(1)
        max_units = proxy_units(point.c.batch, longest, unit_ms)
        profiler = StageProfiler(tracker, step, ProxyKernel(point.c.batch, max_units=max_units), runner,
                                 steps_per_point=steps_per_point, warmup=1, paired=True)
        key = ProfileKey.of(point.model_cfg, point.plan.tables(), 1, point.c.batch, "cpu")
        profile = profiler.run(key, threshold=threshold, max_units=max_units)
    finally:
        runner.close()
        tracker.detach()
    profile_s = time.perf_counter() - t0
    sched = plan_schedule(point.plan, point.ds, point.model_cfg, 1, point.c.batch, "mlp_bwd", None,
                          threads=corun_threads, profile=profile,  # the point's form timed (its own executor)
                          executor=build_executor(point.c.form, point.plan, point.ds, point.executor.compiled))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inline_prep = batch_ms(point.executor, point.ds, point.c.batch)
    finally:
        torch.set_num_threads(before)
    early_ms = corun_thread_iteration_ms(profile.stage_ms, profile.capacity_ms, inline_prep, "emb_fwd")
    ideal = sum(profile.stage_ms.values())
    kernels = sum(a.predicted_ms for a in sched.assignments)
    corun = float(sched.meta["predicted_iteration_ms"])
    unhidden = float(sched.meta.get("unhidden_ms", 0.0))
    return sched, {
        "stage_ms": {s: round(v, 3) for s, v in profile.stage_ms.items()},
        "capacity_ms": {s: round(v, 3) for s, v in profile.capacity_ms.items()},
        "ideal_step_ms": ideal, "inline_step_ms": ideal + inline_prep, "corun_step_ms": corun,
        "inline_preprocess_ms": inline_prep, "corun_kernel_ms": kernels, "unhidden_ms": unhidden,
        "hidden_fraction": min(1.0, max(0.0, 1.0 - unhidden / kernels)) if kernels > 0 else 1.0,  # (rounding: -2e-16)
        "corun_vs_ideal": ideal / corun, "corun_vs_inline": (ideal + inline_prep) / corun,
        "share": inline_prep / (ideal + inline_prep),
        # corun_early: the whole batch (inline's own executor call) from emb_fwd, spanning every stage's capacity
        "corun_early_step_ms": early_ms, "corun_early_vs_ideal": ideal / early_ms,
        "corun_early_vs_inline": (ideal + inline_prep) / early_ms,
        "profile_seconds": round(profile_s, 2), "threshold": threshold,
        "by": "stage profiler (paired, proxy on the co-run thread) -> rap.planning.scheduler -> simulator 'rap'",
    }


class StepClock(PhaseTimes):
    """The step loop's phase timer, also keeping every step's wall milliseconds per phase (a step ends at its
    `coordination` mark), so an epoch's first step (a co-run's pipeline fill: batch 0 preprocessed before step 0,
    nothing to hide behind) can be told from the steady state."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_ms: list[dict[str, float]] = []
        self._cur: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self._cur[phase] = self._cur.get(phase, 0.0) + (time.perf_counter() - self._t) * 1e3
        super().mark(phase)
        if phase == "coordination":
            self.steps_ms.append(self._cur)
            self._cur = {}


def steady_ms(clocks: list[StepClock]) -> float:
    """Median step milliseconds over every step of the epochs but each one's first."""
    steps = [sum(s.values()) for c in clocks for s in c.steps_ms[1:]]
    if not steps:
        raise ValueError("steady_ms: no epoch had more than one step (use --steps >= 2)")
    return statistics.median(steps)


def phase_ms(clocks: list[StepClock]) -> dict[str, float]:
    """Median milliseconds per phase over the same steps as steady_ms."""
    steps = [s for c in clocks for s in c.steps_ms[1:]]
    return {k: round(statistics.median(s.get(k, 0.0) for s in steps), 3) for k in ("data", "forward", "backward",
                                                                                   "optimizer", "coordination")}


def measure(point: Point, sched, args, root: Path, progress=None, task=None) -> dict[str, Any]:
    """ideal / inline / corun over the real trainer (bench_rap.run_epoch) in interleaved rounds."""
    c = point.c
    rows = c.batch * args.steps
    manifest, shard_rows = make_data(point.ds, rows, c.batch * args.batches_per_task, root / c.name.replace("/", "_"),
                                     args.seed)
    ctx: dict[str, Any] = {
        "plan": point.plan, "ds": point.ds, "manifest": manifest, "shard_rows": shard_rows, "batch": c.batch,
        "executor": point.executor, "schedule": sched, "corun_threads": args.corun_threads,
        "corun_executor": build_executor(c.form, point.plan, point.ds, point.executor.compiled),
        "rows_in_memory": {i: RawBatch.from_arrow(read_rows(manifest, i, 0, n), point.ds)
                           for i, n in enumerate(shard_rows)}}
    early = {**ctx, "schedule": whole_kernel_schedule(point.executor.compiled, "emb_fwd"),
             "corun_executor": build_executor(c.form, point.plan, point.ds, point.executor.compiled),
             "corun_summaries": []}

    def epoch(v: str, sharded, losses=None, clock: StepClock | None = None) -> tuple[float, int]:
        if v == "corun_early":
            return run_epoch("corun", sharded, early, losses, phases=clock)
        return run_epoch(v, sharded, ctx, losses, phases=clock)

    curves: dict[str, list[float]] = {}
    if args.check_losses:
        for v in VARIANTS:
            curves[v] = []
            epoch(v, point.fresh(), curves[v])
    sharded = point.fresh()
    for v in VARIANTS:
        epoch(v, sharded)  # warm-up
    ctx["corun_summaries"], early["corun_summaries"] = [], []
    step: dict[str, list[float]] = {v: [] for v in VARIANTS}  # per round: the epoch's wall / steps (fill included)
    clocks: dict[str, list[StepClock]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            clock = StepClock()
            wall, steps = epoch(v, sharded, clock=clock)
            step[v].append(wall / steps * 1e3)
            clocks[v].append(clock)
        if progress is not None:
            progress.advance(task)
    RowsInMemory.rows = {}
    # the steady state (every step but each epoch's first) is what the ratios use: a pipeline's epoch is thousands of
    # steps, where the co-run's one-batch fill is nothing; the epochs here are --steps long, so it is reported apart
    med = {v: steady_ms(clocks[v]) for v in VARIANTS}
    epoch_med = {v: statistics.median(step[v]) for v in VARIANTS}
    summary = ctx["corun_summaries"][len(ctx["corun_summaries"]) // 2]
    early_summary = early["corun_summaries"][len(early["corun_summaries"]) // 2]
    kernel, wait = summary.get("kernel_ms", 0.0), summary.get("wait_ms", 0.0)
    ek, ew = early_summary.get("kernel_ms", 0.0), early_summary.get("wait_ms", 0.0)
    return {
        "step_ms": {v: {"median": med[v], "epoch_median": epoch_med[v], "rounds": step[v],
                        "first_step_ms": [round(sum(c.steps_ms[0].values()), 3) for c in clocks[v] if c.steps_ms],
                        "phase_ms": phase_ms(clocks[v])} for v in VARIANTS},
        "measured_as": "steady state: median step over every step of the rounds' epochs but each one's first",
        # the share of the inline step beyond the ideal one, as the steps measured here give it (`share`: calibration)
        "measured_share": 1.0 - med["ideal"] / med["inline"],
        "epoch_corun_vs_ideal": epoch_med["ideal"] / epoch_med["corun"],
        "epoch_corun_vs_inline": epoch_med["inline"] / epoch_med["corun"],
        "epoch_corun_early_vs_ideal": epoch_med["ideal"] / epoch_med["corun_early"],
        "epoch_corun_early_vs_inline": epoch_med["inline"] / epoch_med["corun_early"],
        "samples_per_s": {v: c.batch / med[v] * 1e3 for v in VARIANTS},
        "corun_vs_ideal": med["ideal"] / med["corun"], "inline_vs_ideal": med["ideal"] / med["inline"],
        "corun_vs_inline": med["inline"] / med["corun"],
        "corun_early_vs_ideal": med["ideal"] / med["corun_early"],
        "corun_early_vs_inline": med["inline"] / med["corun_early"],
        "corun_early_hidden_fraction": max(0.0, 1.0 - ew / ek) if ek > 0 else None,
        # what the trainer did not wait for, of the co-run thread's kernel time (the runtime's own timing)
        "hidden_fraction": max(0.0, 1.0 - wait / kernel) if kernel > 0 else None,
        # the step time co-running added over ideal, against inline's
        "overhead_hidden": (1.0 - (med["corun"] - med["ideal"]) / (med["inline"] - med["ideal"])
                            if med["inline"] > med["ideal"] else None),
        "loss_curves_equal": all(curves[v] == curves["ideal"] for v in VARIANTS) if curves else None,
        "corun": {k: v for k, v in summary.items() if k != "schedule"},
        "corun_early": {k: v for k, v in early_summary.items() if k != "schedule"},
        "schedule_stages": sorted({a.stage for a in sched.assignments}),
    }


# ------------------------------------------------------------------ report


def plot(points: list[dict[str, Any]], out: Path) -> None:
    import matplotlib  # lazy: only when the chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend

    pts = sorted(points, key=lambda p: p["share"])
    x = [100 * p["share"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [p["measured"]["corun_vs_ideal"] for p in pts], "o-", color="C0", label="co-run / ideal (measured)")
    ax.plot(x, [p["measured"]["corun_vs_inline"] for p in pts], "s-", color="C1", label="co-run / inline (measured)")
    ax.plot(x, [p["predicted"]["corun_vs_ideal"] for p in pts], "o--", mfc="none", color="C0",
            label="co-run / ideal (RAP's prediction)")
    ax.plot(x, [p["predicted"]["corun_vs_inline"] for p in pts], "s--", mfc="none", color="C1",
            label="co-run / inline (RAP's prediction)")
    ax.plot(x, [p["measured"]["inline_vs_ideal"] for p in pts], "^:", color="C2", label="inline / ideal (measured)")
    ax.plot(x, [p["measured"]["corun_early_vs_ideal"] for p in pts], "D-", color="C3",
            label="co-run from emb_fwd / ideal (measured)")
    ax.plot(x, [p["measured"]["corun_early_vs_inline"] for p in pts], "D-", color="C4",
            label="co-run from emb_fwd / inline (measured)")
    ax.plot(x, [p["predicted"]["corun_early_vs_inline"] for p in pts], "D--", mfc="none", color="C4",
            label="co-run from emb_fwd / inline (prediction)")
    ax.axhline(0.9, color="C0", lw=0.6, ls=":")
    ax.axhline(1.3, color="C1", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("fused preprocessing, % of the inline step (measured: p / (t + p))")
    ax.set_ylabel("throughput ratio")
    ax.set_title("RAP co-run against ideal and inline (samples/s ratios, medians)", fontsize=9)
    for p, xi in zip(pts, x, strict=True):
        ax.annotate(p["name"], (xi, p["measured"]["corun_vs_ideal"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)
    print(f"wrote {out}")



def print_table(points: list[dict[str, Any]]) -> None:
    print(f"{'point':22s} {'share':>6s} {'meas.':>6s} {'ideal ms':>9s} {'inline':>8s} {'corun':>8s}  {'co/ideal':>8s} "
          f"{'pred':>6s}  {'co/inl':>7s} {'pred':>6s}  {'hidden':>6s} {'pred':>6s}  {'early/id':>8s} "
          f"{'early/inl':>9s} {'pred':>6s}  {'epoch co/id':>11s} {'co/inl':>6s}")
    for p in points:
        m, q = p["measured"], p["predicted"]
        s = m["step_ms"]
        hid = m["hidden_fraction"]
        print(f"{p['name']:22s} {100 * p['share']:5.1f}% {100 * m['measured_share']:5.1f}% "
              f"{s['ideal']['median']:9.1f} {s['inline']['median']:8.1f} "
              f"{s['corun']['median']:8.1f}  {m['corun_vs_ideal']:8.3f} {q['corun_vs_ideal']:6.3f}  "
              f"{m['corun_vs_inline']:7.3f} {q['corun_vs_inline']:6.3f}  "
              f"{'-' if hid is None else f'{hid:.2f}':>6s} {q['hidden_fraction']:6.2f}  "
              f"{m['corun_early_vs_ideal']:8.3f} {m['corun_early_vs_inline']:9.3f} "
              f"{q['corun_early_vs_inline']:6.3f}  {m['epoch_corun_vs_ideal']:11.3f} {m['epoch_corun_vs_inline']:6.3f}")
    print("(share: the calibration's, meas.: 1 - ideal / inline of the steps below; "
          "steady-state step ms: medians over every step but each epoch's first; ratios of samples/s; pred = RAP's "
          "profile-based prediction; hidden = share of the co-run kernels' time the trainer did not wait for; early = "
          "every kernel from emb_fwd; epoch = the epochs' wall / steps, the co-run's one-batch fill included)")


def autogroup() -> str | None:
    """This process's scheduler autogroup and its nice ("/autogroup-N nice K"; None where the kernel has none).
    With autogroups on, a process's own nice weighs only against its session's processes: other sessions' work
    shares the cores with this one by the autogroups' nice, whatever `nice` each command ran under."""
    try:
        on = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
        return Path("/proc/self/autogroup").read_text().strip() if on else None
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="plan0,plan2")
    ap.add_argument("--models", default="small,tiny,micro", help=f"model sizes: {sorted(MODELS)}")
    ap.add_argument("--batches", default="2048")
    ap.add_argument("--forms", default="single,grouped", help=f"fused executor forms: {list(FORMS)}")
    ap.add_argument("--targets", default="0.03,0.28,0.5",
                    help="preprocessing shares of the inline step to aim at")
    ap.add_argument("--steps", type=int, default=6, help="steps per epoch (= rows / batch)")
    ap.add_argument("--batches-per-task", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's intra-op threads")
    ap.add_argument("--corun-threads", type=int, default=1, help="the co-run thread's intra-op threads")
    ap.add_argument("--profile-steps", type=int, default=3, help="the stage profiler's steps per point (paired)")
    ap.add_argument("--threshold", type=float, default=0.10, help="the profiler's slowdown threshold (CPU: 10%%)")
    ap.add_argument("--no-check-losses", dest="check_losses", action="store_false",
                    help="skip the per-step loss comparison of the three variants")
    ap.add_argument("--calibrate-only", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_rap_share.json")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit(f"refused: --steps {args.steps}; the steady state is every step of an epoch but its first, "
                         "so an epoch needs at least 2")
    candidates = parse_candidates(args.plans, args.models, args.batches, args.forms)
    targets = [float(t) for t in args.targets.split(",") if t.strip()]
    check_machine(candidates, args.threads, args.corun_threads, max(c.batch for c in candidates) * args.steps)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"trainer threads {args.threads}, co-run threads {args.corun_threads}; {cpu_model()}, "
          f"{os.cpu_count()} cpus, load average {load_start}, autogroup {autogroup()}", flush=True)
    from rich.progress import Progress  # lazy: the progress bar only when run as a script

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_rap_share_") as tmp, Progress() as progress:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            task = progress.add_task("calibrating", total=len(candidates))
            calib = []
            for c in candidates:
                calib.append(calibrate(c, args.seed))
                progress.console.print(f"  {c.name:22s} ideal step {calib[-1]['ideal_step_ms']:8.1f} ms, fused "
                                       f"preprocessing {calib[-1]['preprocess_ms']:7.2f} ms: share "
                                       f"{100 * calib[-1]['share']:.1f}%" + (
                                           "" if calib[-1]["torchscript_share"] is None else
                                           f", {100 * calib[-1]['torchscript_share']:.0f}% of it in TorchScript"))
                progress.advance(task)
            chosen = choose_points({Candidate(**r["candidate"]): r["share"] for r in calib}, targets)
            points = []
            if not args.calibrate_only:
                task = progress.add_task("rounds", total=len(chosen) * args.rounds)
                for target, c in chosen:
                    point = Point(c, args.seed)
                    share = next(r["share"] for r in calib if r["name"] == c.name)
                    sched, predicted = predict(point, args.threads, args.corun_threads, args.profile_steps,
                                               args.threshold)
                    measured = measure(point, sched, args, Path(tmp), progress, task)
                    points.append({"name": c.name, "target_share": target, "share": share,
                                   "candidate": asdict(c), "predicted": predicted, "measured": measured})
        finally:
            dist.destroy_process_group()
    if points:
        print_table(points)
    report = {
        "machine": {"platform": platform.platform(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg(),
                    "autogroup": autogroup(),
                    "memory_available_gib": round(psutil.virtual_memory().available / 2**30, 2)},
        "settings": ({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                     | {"torch": torch.__version__, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                        "models": MODELS}),
        "how_points_were_chosen": "each candidate's share measured first (fused executor over one batch / median "
                                  "ideal step on ready batches), then per target the closest share in log space",
        "calibration": calib, "chosen": [{"target": t, "name": c.name} for t, c in chosen],
        "points": points, "seconds": round(time.perf_counter() - t_start, 1),
    }
    write_report(args.out, report)
    if points:
        plot(points, args.out.parent / (args.out.stem.removeprefix("bench_") + ".png"))  # rap_share[_suffix].png


if __name__ == "__main__":
    main()
