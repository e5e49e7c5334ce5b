"""RAP co-run runtime: the co-run preprocessing gives what the fused executor gives, the trainer consumes it
(per-step losses equal training on batches preprocessed beforehand), kernels start at their stage, and a bad
setup fails before training."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist

from recforge.config import DatasetConfig, DenseFeature, ModelConfig, SparseFeature, TrainConfig
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest
from recforge.elastic.master.tasks import Task
from recforge.preprocess.columns import BatchError
from recforge.preprocess.executor import make_executor
from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.planning.plan import criteo_plan
from recforge.preprocess.synth import random_raw_batch
from recforge.rap.mapping.milp import Placement, split_rank_plan
from recforge.rap.planning.schedule import Assignment, CorunSchedule, ScheduleError, split_units, whole_kernel_schedule
from recforge.rap.profiling.stages import STAGES, StageTracker
from recforge.rap.runtime.corun_batches import PreprocessedBatches
from recforge.rap.runtime.corun_runtime import CorunConfigError, CorunRuntime
from recforge.rap.runtime.offline import OfflineError, OfflineTaskBatches, preprocess_manifest
from recforge.rap.runtime.session import CorunSession
from recforge.train.loop.batches import TaskBatches
from recforge.train.loop.step_loop import LoopState, train_epoch
from recforge.train.model import build_dlrm
from recforge.train.sharding import shard_model

DS = DatasetConfig(
    name="rap_tiny",
    dense=[DenseFeature(name=f"I{i}", missing_rate=0.2) for i in range(1, 4)],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c, missing_rate=0.1) for i, c in enumerate([50, 300, 7, 90], 1)],
)
PLAN = criteo_plan(DS, table_cap=64)
BATCH = 32


def spread_schedule(compiled) -> CorunSchedule:
    """Groups spread over all five stages in execution order, the largest group split across two stages."""
    groups = compiled.groups
    big = max(range(len(groups)), key=lambda i: len(groups[i].nodes))
    items = []
    for i, g in enumerate(groups):
        stage = STAGES[min(len(STAGES) - 1, i * len(STAGES) // len(groups))]
        units = split_units(compiled, g)
        if i == big and len(units) > 1:
            half = len(units) // 2
            nxt = STAGES[min(len(STAGES) - 1, STAGES.index(stage) + 1)]
            items.append(Assignment(stage, g.name, tuple(f for u in units[:half] for f in u), 0.1))
            items.append(Assignment(nxt, g.name, tuple(f for u in units[half:] for f in u), 0.1))
        else:
            items.append(Assignment(stage, g.name, tuple(f for u in units for f in u), 0.1))
    # the split part in the next stage may precede groups listed later in the earlier stage: keep stage order
    items.sort(key=lambda a: STAGES.index(a.stage))
    return CorunSchedule(stages=STAGES, assignments=items, plan_name=compiled.plan.name)


@pytest.fixture(scope="module")
def compiled():
    return compile_plan(PLAN, method="greedy")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    if dist.is_initialized():  # another module's single-rank group: used, and left to it
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()  # a later module (in this process or an xdist worker's) may start its own


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rap_data")
    generate_days(DS, root / "raw", days=1, rows_per_day=300, seed=4)
    ingest([root / "raw" / "day_0.tsv"], DS, root / "data", rows_per_shard=160, max_bad_fraction=0.0)
    return root / "data"


class Client:
    """The job master's lease/done as a fixed task list (TaskClient)."""

    def __init__(self):
        self.tasks = [Task(task_id=f"t{i}", epoch=0, shard=s, row_start=a, row_end=b)
                      for i, (s, a, b) in enumerate([(0, 0, 70), (0, 70, 160), (1, 0, 50), (1, 50, 140)])]
        self.done_ids: list[str] = []

    def lease(self):
        return self.tasks.pop(0) if self.tasks else None

    def done(self, task_id, samples):
        self.done_ids.append(task_id)
        return True


def _train(mode: str, manifest_dir, compiled, schedule=None):
    torch.manual_seed(7)
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), PLAN.tables(),
                       len(PLAN.dense_features()))
    sharded = shard_model(model, TrainConfig(batch_size=BATCH, sharding="table_wise"), world_size=1,
                          device=torch.device("cpu"))
    client, cpu = Client(), torch.device("cpu")
    executor = make_executor("fused", PLAN, DS, compiled=compiled)
    session = None
    if mode == "corun":
        session = CorunSession(PLAN, DS, schedule, sharded.model, cpu, sharding=sharded.plan_summary(),
                               executor=make_executor("fused", PLAN, DS, compiled=compiled))
        source = session.batches(client, manifest_dir, DS, BATCH, cpu)
    elif mode == "offline_files":
        preprocess_manifest(manifest_dir, PLAN, DS, manifest_dir.parent / "preprocessed")
        source = OfflineTaskBatches(client, manifest_dir.parent / "preprocessed", DS, BATCH, cpu)
    else:
        source = TaskBatches(client, manifest_dir, DS, executor, BATCH, cpu)
        if mode == "offline":
            source = PreprocessedBatches(source)
    losses: list[float] = []
    state = LoopState()
    zero = None
    train_epoch(sharded, source, zero, state, epoch=0, world_size=1, log_every=1,
                sink=lambda m, step: losses.append(m["train_loss"]))
    if session is not None:
        session.close()
    return losses, client.done_ids, session


def test_corun_output_equals_fused_executor(compiled):
    """Gates opened one stage at a time from another thread, like a training step, and all at once."""
    executor = make_executor("fused", PLAN, DS, compiled=compiled)
    for schedule in (spread_schedule(compiled), whole_kernel_schedule(compiled, "allreduce")):
        runtime = CorunRuntime(make_executor("fused", PLAN, DS, compiled=compiled), schedule)
        for seed in range(3):
            raw = random_raw_batch(DS, 97, seed=seed)
            pending = runtime.launch(raw)
            if seed:
                opened = STAGES[:seed + 2]
                stepper = threading.Thread(target=lambda rt=runtime, opened=opened: [rt.on_enter(s) for s in opened])
                stepper.start()
                stepper.join()
            dense, kjt = pending.result()
            ref_dense, ref_kjt = executor(raw)
            assert torch.equal(dense, ref_dense)
            assert kjt.keys() == ref_kjt.keys()
            assert torch.equal(kjt.values(), ref_kjt.values()) and torch.equal(kjt.lengths(), ref_kjt.lengths())
        assert len(runtime.cycles) == 3 and runtime.cycles[2].opened_by_step == list(STAGES[:4])
        runtime.close()


def test_kernels_wait_for_their_stage(compiled):
    schedule = whole_kernel_schedule(compiled, "mlp_bwd")
    runtime = CorunRuntime(make_executor("fused", PLAN, DS, compiled=compiled), schedule)
    pending = runtime.launch(random_raw_batch(DS, 16, seed=1))
    runtime.on_enter("emb_fwd")
    runtime.on_enter("mlp_fwd")
    assert not pending._future.done()  # its stage has not begun
    runtime.on_enter("mlp_bwd")
    pending._future.result(timeout=30)  # runs without result() opening anything
    dense, _ = pending.result()
    assert dense.shape == (16, len(PLAN.dense_features()))
    assert runtime.cycles[0].opened_by_step == ["emb_fwd", "mlp_fwd", "mlp_bwd"]
    assert set(runtime.cycles[0].run_ms) == {"mlp_bwd"}
    runtime.close()


def test_corun_loss_curve_equals_preprocessed_beforehand(process_group, manifest_dir, compiled):
    offline, done_off, _ = _train("offline", manifest_dir, compiled)
    inline, _, _ = _train("inline", manifest_dir, compiled)
    corun, done_co, session = _train("corun", manifest_dir, compiled, spread_schedule(compiled))
    files, done_files, _ = _train("offline_files", manifest_dir, compiled)
    assert len(offline) == len(corun) == 11  # 70, 90, 50, 90 rows in batches of 32: 3 + 3 + 2 + 3
    assert corun == offline == inline  # per step, exactly: the same ids and values reach the model
    # preprocessed whole shards ahead (the pipeline's offline mode): the same rows and padding, to float tolerance
    assert files == pytest.approx(offline, rel=1e-6, abs=1e-7)
    assert done_co == done_off == done_files == ["t0", "t1", "t2", "t3"]
    summary = session.summary()
    assert summary["steps"] == 11 and summary["batches"] == 11
    # the step opened every stage for the batches read ahead (all but the first)
    assert [len(c.opened_by_step) for c in session.runtime.cycles[1:]] == [5] * 10
    assert summary["measured_iteration_ms"] > 0 and set(summary["measured_stage_ms"]) == set(STAGES)
    # each step closed when its batch was reported trained; one iteration per step, batch request to batch request
    assert len(session.tracker.steps) == len(session.iteration_ms) == 11 and session.tracker.stage is None


def test_progress_counts_only_rows_handed_to_the_trainer(process_group, manifest_dir, compiled):
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), PLAN.tables(),
                       len(PLAN.dense_features()))
    session = CorunSession(PLAN, DS, whole_kernel_schedule(compiled, "emb_fwd"), model,
                           executor=make_executor("fused", PLAN, DS, compiled=compiled))
    client = Client()
    src = session.batches(client, manifest_dir, DS, BATCH, torch.device("cpu"))
    seen = []
    while (b := src.next()) is not None:
        seen.append((b.task_id, b.row_end))
        # read ahead one batch, but progress names only what was handed out, and no task already done
        assert src.progress() == {b.task_id: b.row_end - {"t0": 0, "t1": 70, "t2": 0, "t3": 50}[b.task_id]}
        src.trained(b)
        if b.last_of_task:
            assert b.task_id not in src.progress()
    assert len(seen) == 11 and client.done_ids == ["t0", "t1", "t2", "t3"]
    session.close()


def test_bad_schedules_fail_before_training(compiled):
    ex = make_executor("fused", PLAN, DS, compiled=compiled)
    whole = whole_kernel_schedule(compiled, "emb_fwd")
    missing = CorunSchedule(STAGES, whole.assignments[:-1], whole.plan_name)
    with pytest.raises(ScheduleError, match=compiled.groups[-1].name.replace("[", r"\[")):
        CorunRuntime(ex, missing)
    unknown = CorunSchedule(STAGES, [*whole.assignments, Assignment("emb_fwd", "L9:nope", ("x",), 0.0)],
                            whole.plan_name)
    with pytest.raises(ScheduleError, match="L9:nope"):
        CorunRuntime(ex, unknown)
    # a kernel listed before the kernel that feeds it
    with pytest.raises(ScheduleError, match="before its input"):
        CorunRuntime(ex, CorunSchedule(STAGES, list(reversed(whole.assignments)), whole.plan_name))


def test_plan_features_missing_from_sharding_fail(compiled):
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), PLAN.tables(),
                       len(PLAN.dense_features()))
    sharding = {t: {} for t, _ in PLAN.tables() if t != "C3"}
    with pytest.raises(CorunConfigError, match="C3"):
        CorunSession(PLAN, DS, whole_kernel_schedule(compiled, "emb_fwd"), model, sharding=sharding,
                     executor=make_executor("fused", PLAN, DS, compiled=compiled))


def test_corun_threads_above_the_trainers_are_refused(compiled):
    with pytest.raises(CorunConfigError, match="threads"):
        CorunRuntime(make_executor("fused", PLAN, DS, compiled=compiled), whole_kernel_schedule(compiled, "emb_fwd"),
                     threads=torch.get_num_threads() + 1)


def test_offline_refuses_a_varying_number_of_ids_per_row():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recforge.rap.runtime.offline import _as_matrix

    fixed = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(9), lengths=torch.tensor([1, 1, 1, 2, 2, 2]),
                              stride=3)
    ids, widths = _as_matrix(fixed, 3)
    assert widths == [1, 2] and ids.tolist() == [[0, 3, 4], [1, 5, 6], [2, 7, 8]]
    ragged = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(7), lengths=torch.tensor([1, 1, 1, 2, 0, 2]),
                               stride=3)
    with pytest.raises(OfflineError, match="'b'"):
        _as_matrix(ragged, 3)


def test_plan_schedule_uses_a_stored_profile_else_one_stage(tmp_path):
    from recforge.rap.planning.job_schedule import plan_schedule
    from recforge.rap.profiling.profiler import ProfileKey, StageProfile

    model = ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])
    plain = plan_schedule(PLAN, DS, model, world_size=2, batch_size=64, stage="emb_bwd", profile_dir=tmp_path)
    assert {a.stage for a in plain.assignments} == {"emb_bwd"} and "predicted_iteration_ms" not in plain.meta
    assert all(a.predicted_ms > 0 for a in plain.assignments)  # each group timed on 64 synthetic rows
    # a profile for this job: only emb_fwd and allreduce have room, allreduce the most per ms
    stage_ms = {"emb_fwd": 4.0, "mlp_fwd": 6.0, "mlp_bwd": 8.0, "emb_bwd": 3.0, "allreduce": 2.0}
    capacity = {"emb_fwd": 1.0, "mlp_fwd": 0.0, "mlp_bwd": 0.0, "emb_bwd": 0.0, "allreduce": 1e3}
    key = ProfileKey.of(model, PLAN.tables(), 2, 64, "cpu")
    StageProfile(key=key, stage_ms=stage_ms, capacity_units={s: 1 for s in STAGES}, capacity_ms=capacity,
                 unit_ms=0.01, threshold=0.02).save(tmp_path)
    planned = plan_schedule(PLAN, DS, model, world_size=2, batch_size=64, stage="emb_bwd", profile_dir=tmp_path)
    # RAP's schedule: everything in the all-reduce window, nothing unhidden; on a CPU the co-run thread runs the
    # whole batch from emb_fwd instead (job_schedule.cpu_schedule), which runs on into that window
    assert planned.meta["rap_schedule_stages"] == ["allreduce"]
    assert planned.meta["rap_schedule_iteration_ms"] == pytest.approx(sum(stage_ms.values()))  # nothing unhidden
    assert {a.stage for a in planned.assignments} == {"emb_fwd"}
    assert planned.meta["predicted_iteration_ms"] == pytest.approx(sum(stage_ms.values()))
    # another world size has no profile: back to one stage
    other = plan_schedule(PLAN, DS, model, world_size=4, batch_size=64, stage="emb_bwd", profile_dir=tmp_path)
    assert {a.stage for a in other.assignments} == {"emb_bwd"}


# ------------------------------------------------------------------ several jobs: RAP's mapping on rank 0 of 2

WORLD = 2
PLACEMENTS = {"C1": Placement("table_wise", (0,)), "C2": Placement("table_wise", (1,)),
              "C3": Placement("column_wise", (0, 1)), "C4": Placement("data_parallel", (0, 1))}


@pytest.fixture(scope="module")
def mapped():
    """Rank 0's (global, local) compiled plans: C1, C3 over the global batch; I1-I3, C4 over its local batch."""
    local, global_ = split_rank_plan(PLAN, PLACEMENTS, 0)
    return compile_plan(global_, method="greedy"), compile_plan(local, method="greedy")


def _mapped_raws(seed: int):
    """A global batch (both ranks' batches; C3 a list column, so its KJT is jagged) and rank 0's local batch."""
    return [random_raw_batch(DS, WORLD * BATCH, seed=seed, list_columns=("C3",)),
            random_raw_batch(DS, BATCH, seed=seed + 100)]


def _executor(compiled):
    return make_executor("fused", compiled.plan, DS, compiled=compiled)


def _assert_same(out, ref):
    (dense, kjt), (ref_dense, ref_kjt) = out, ref
    assert torch.equal(dense, ref_dense) and dense.shape == ref_dense.shape
    assert kjt.keys() == ref_kjt.keys()
    assert torch.equal(kjt.values(), ref_kjt.values()) and torch.equal(kjt.lengths(), ref_kjt.lengths())


def _mapped_runtime(mapped, make_schedule=spread_schedule):
    jobs = []
    for compiled, job in zip(mapped, ("global", "local"), strict=True):
        sched = make_schedule(compiled)
        sched.meta["job"] = job
        jobs.append((_executor(compiled), sched))
    return CorunRuntime(jobs=jobs)


def test_split_rank_plans_give_the_full_plans_features(mapped):
    """The global job gives a KJT of the held tables (dense [rows, 0]); the local one the dense features and the
    data_parallel table: what the whole plan's executor gives for those features over the same rows."""
    global_c, local_c = mapped
    full = make_executor("fused", PLAN, DS, compiled=compile_plan(PLAN, method="greedy"))
    global_raw, local_raw = _mapped_raws(0)
    dense, kjt = _executor(global_c)(global_raw)
    assert dense.shape == (WORLD * BATCH, 0) and kjt.keys() == ["C1", "C3"] and kjt.stride() == WORLD * BATCH
    ref = full(global_raw)[1]
    assert not bool((kjt["C3"].lengths() == 1).all())  # C3 is jagged here
    for key in ("C1", "C3"):
        assert torch.equal(kjt[key].values(), ref[key].values()) and torch.equal(kjt[key].lengths(), ref[key].lengths())
    dense, kjt = _executor(local_c)(local_raw)
    ref_dense, ref = full(local_raw)
    assert torch.equal(dense, ref_dense) and dense.shape == (BATCH, 3) and kjt.keys() == ["C4"]
    assert torch.equal(kjt["C4"].values(), ref["C4"].values())


def test_jobs_equal_their_executors_with_gates_opened_by_a_training_step(mapped):
    runtime = _mapped_runtime(mapped)
    assert runtime.job_names() == ["global", "local"]
    refs = [_executor(c) for c in mapped]
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), PLAN.tables(),
                       len(PLAN.dense_features()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = StageTracker(model, on_enter=runtime.on_enter)
    step_dense, step_kjt = make_executor("fused", PLAN, DS)(random_raw_batch(DS, BATCH, seed=9))
    for seed in range(2):
        raws = _mapped_raws(seed)
        pending = runtime.launch_many(raws)
        logits = model(step_dense, step_kjt)
        logits.sum().backward()
        opt.step()
        opt.zero_grad()
        tracker.step_end()
        pending._future.result(timeout=60)  # the step's gates alone let every kernel run
        outs = pending.results()
        assert len(outs) == 2
        for out, ref, raw in zip(outs, refs, raws, strict=True):
            _assert_same(out, ref(raw))
        assert pending.timing.opened_by_step == list(STAGES)
    tracker.detach()
    summary = runtime.summary()
    assert summary["batches"] == 2
    assert summary["predicted_kernel_ms"] == pytest.approx(0.1 * sum(len(j.schedule.assignments) for j in runtime.jobs))
    assert [j["job"] for j in summary["kernel_ms_by_job"]] == ["global", "local"]
    # every stage of the spread schedules ran kernels, timed once over both jobs
    assert set(summary["kernel_ms_by_stage"]) == set(STAGES)
    for c in runtime.cycles:
        assert sum(c.job_run_ms) <= sum(c.run_ms.values()) + 1e-6
    runtime.close()


def test_jobs_without_a_step_run_as_leftovers(mapped):
    runtime = _mapped_runtime(mapped)
    refs = [_executor(c) for c in mapped]
    calls = []  # (stage, job) of every part run, seen through the real executors' run_group
    for ji, job in enumerate(runtime.jobs):
        stage_of = {p.key: p.assignment.stage for p in runtime.job_parts[ji]}
        real = job.executor.run_group
        job.executor.run_group = (lambda key, *a, _ji=ji, _real=real, _stage=stage_of:
                                  (calls.append((_stage[key], _ji)), _real(key, *a)))
    for seed in range(2):
        raws = _mapped_raws(seed)
        pending = runtime.launch_many(raws)
        if seed:  # a step that reached only its first two stages
            stepper = threading.Thread(target=lambda: [runtime.on_enter(s) for s in STAGES[:2]])
            stepper.start()
            stepper.join()
        for out, ref, raw in zip(pending.results(), refs, raws, strict=True):
            _assert_same(out, ref(raw))
        assert pending.timing.opened_by_step == list(STAGES[:2 * seed])
        # stage by stage, and within a stage job 0's parts before job 1's
        assert calls == sorted(calls, key=lambda c: (STAGES.index(c[0]), c[1])) and {j for _, j in calls} == {0, 1}
        calls.clear()
    runtime.close()


def test_mapped_rank_schedules_run_on_the_runtime():
    """The scheduler's two jobs, kernels split at tight capacities, straight into the runtime."""
    from recforge.rap.planning.scheduler import mapped_rank_schedules

    def cost_of(compiled, rows):
        return lambda g: 0.01 + 1e-3 * len(g.nodes) * rows

    jobs = mapped_rank_schedules(PLAN, PLACEMENTS, 0, WORLD, BATCH, dict.fromkeys(STAGES, 1.0),
                                 dict.fromkeys(STAGES, 0.1), cost_of)
    assert [s.meta["job"] for _, s in jobs] == ["global", "local"]
    assert sum(s.meta["split_kernels"] for _, s in jobs) > 0
    assert sum(len({a.stage for a in s.assignments}) for _, s in jobs) > 2
    runtime = CorunRuntime(jobs=[(_executor(c), s) for c, s in jobs])
    raws = _mapped_raws(5)
    for out, (compiled, _), raw in zip(runtime.launch_many(raws).results(), jobs, raws, strict=True):
        _assert_same(out, _executor(compiled)(raw))
    summary = runtime.summary()
    assert summary["predicted_kernel_ms"] == pytest.approx(sum(a.predicted_ms for _, s in jobs for a in s.assignments),
                                                           abs=1e-4)
    assert summary["kernel_ms_by_job"][1]["predicted_kernel_ms"] == pytest.approx(jobs[1][1].meta["total_predicted_ms"],
                                                                                  abs=1e-4)  # not split
    runtime.close()


def test_single_job_runtime_through_jobs(compiled):
    ex = make_executor("fused", PLAN, DS, compiled=compiled)
    sched = spread_schedule(compiled)
    runtime = CorunRuntime(jobs=[(ex, sched)])
    assert runtime.executor is ex and runtime.schedule is sched and runtime.compiled is compiled
    raw = random_raw_batch(DS, 20, seed=3)
    pending = runtime.launch(raw)
    out = pending.result()
    _assert_same(out, make_executor("fused", PLAN, DS, compiled=compiled)(raw))
    assert len(pending.results()) == 1 and len(runtime.cycles) == 1  # a second call records nothing again
    runtime.close()


def test_bad_jobs_and_raws_are_named(mapped):
    global_c, local_c = mapped
    whole = [whole_kernel_schedule(c, "allreduce", meta={"job": job})
             for c, job in zip(mapped, ("global", "local"), strict=True)]
    # job 1's schedule names a fused group of job 0
    foreign = global_c.groups[1].name
    bad = CorunSchedule(STAGES, [*whole[1].assignments, Assignment("allreduce", foreign, ("C1",), 0.0)],
                        whole[1].plan_name, meta={"job": "local"})
    with pytest.raises(ScheduleError, match=rf"job 1 \('local'.*unknown fused group '{foreign}'"):
        CorunRuntime(jobs=[(_executor(global_c), whole[0]), (_executor(local_c), bad)])
    # job 0's schedule given to job 1
    with pytest.raises(ScheduleError, match=r"job 1 .*schedule is for plan .*\.global"):
        CorunRuntime(jobs=[(_executor(global_c), whole[0]), (_executor(local_c), whole[0])])
    shared = _executor(global_c)
    with pytest.raises(CorunConfigError, match="jobs 0 and 1 share one executor"):
        CorunRuntime(jobs=[(shared, whole[0]), (shared, whole[0])])
    with pytest.raises(CorunConfigError, match="not both"):
        CorunRuntime(shared, whole[0], jobs=[(shared, whole[0])])
    with pytest.raises(CorunConfigError, match="jobs is empty"):
        CorunRuntime(jobs=[])
    with pytest.raises(CorunConfigError, match=r"job 1 \('local'\): EagerExecutor is not a fused executor"):
        CorunRuntime(jobs=[(_executor(global_c), whole[0]), (make_executor("eager", local_c.plan, DS), whole[1])])

    whole[0].meta["rows"], whole[1].meta["rows"] = WORLD * BATCH, BATCH
    runtime = CorunRuntime(jobs=[(_executor(global_c), whole[0]), (_executor(local_c), whole[1])])
    global_raw, local_raw = _mapped_raws(0)
    with pytest.raises(ValueError, match=r"1 raw batches for 2 jobs \['global', 'local'\]"):
        runtime.launch_many([global_raw])
    with pytest.raises(ValueError, match="launch_many"):
        runtime.launch(global_raw)
    with pytest.raises(BatchError, match=r"job 0 \('global'\): raw batch has 32 rows, its schedule was planned for 64"):
        runtime.launch_many([local_raw, global_raw])  # swapped
    narrow = dataclasses.replace(local_raw, dense=local_raw.dense[:, :2], dense_valid=local_raw.dense_valid[:, :2])
    with pytest.raises(BatchError, match=r"job 1 \('local'\): raw batch has 2 dense columns"):
        runtime.launch_many([global_raw, narrow])
    with pytest.raises(AttributeError, match=r"2 jobs \['global', 'local'\]; use runtime.jobs\[i\].executor"):
        _ = runtime.executor
    pending = runtime.launch_many([global_raw, local_raw])
    with pytest.raises(ValueError, match="results"):
        pending.result()
    assert len(pending.results()) == 2
    runtime.close()
