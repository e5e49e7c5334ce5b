"""Cluster simulator on the parameter-server trace (`shape="ps"`): determinism, accounting, faults, policies, CLI.
The TorchRec-shaped default trace and Optimus: test_simulate_torchrec.py."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from recforge.elastic.simulate import run_comparison, truth
from recforge.elastic.simulate.cluster import Cluster, ClusterSpec
from recforge.elastic.simulate.engine import SimParams, simulate
from recforge.elastic.simulate.policies import make_policy
from recforge.elastic.simulate.trace import MISCONFIG, TraceParams, generate_trace

SMALL = TraceParams(shape="ps", n_jobs=20, arrival_window_h=3.0, n_scenarios=6)
CLUSTER = ClusterSpec(nodes=6)



def test_same_seed_same_results_other_seed_other_results():
    a = run_comparison(SMALL, cluster=CLUSTER, seed=3)
    b = run_comparison(SMALL, cluster=CLUSTER, seed=3)
    c = run_comparison(SMALL, cluster=CLUSTER, seed=4)
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    assert [r["jct_h"] for r in a] != [r["jct_h"] for r in c]


def test_every_job_ends_and_the_accounting_is_consistent():
    for r in run_comparison(SMALL, cluster=CLUSTER, seed=1):
        assert r["jobs"] == SMALL.n_jobs
        assert all(p["status"] in ("done", "failed") for p in r["per_job"])
        assert r["completed"] + sum(r["failures"].values()) == r["jobs"]
        assert 0 < r["cpu_utilization"] <= 1 and 0 < r["memory_utilization"] <= 1
        assert r["jct_p95_h"] >= r["jct_median_h"] > 0 and len(r["jct_h"]) == r["completed"]


def test_static_policy_never_changes_a_plan_and_dlrover_decides_with_events():
    static, dl = run_comparison(SMALL, cluster=CLUSTER, policies=("static", "dlrover"), seed=2)
    assert static["plan_changes"] == 0 and static["decisions"] == {}
    decisions = dl["decisions"]
    assert decisions.get("warm_start.cold_start", 0) + decisions.get("warm_start.initial_plan", 0) == SMALL.n_jobs
    assert any(k.startswith("runtime.") for k in dl["decisions"])


def test_a_lone_job_on_an_empty_cluster_finishes_when_the_truth_says():
    job = generate_trace(replace(SMALL, n_jobs=1, p_straggler=0.0, p_hot_server=0.0, misconfig={"reasonable": 1.0}),
                         seed=5)
    job[0].request["memory_per_server"] = 1e13 / 1e3  # plenty: no OOM
    job[0].request["memory_per_worker"] = max(job[0].request["memory_per_worker"], job[0].worker_mem * 2)
    r = simulate(job, make_policy("static"), cluster=ClusterSpec(nodes=50, memory_per_node=1e13), params=SimParams())
    q = job[0].request
    rate = truth.throughput(job[0].coef, job[0].gamma, q["batch_size"], q["workers"], q["cpu_per_worker"], q["servers"],
                            q["cpu_per_server"])
    expected_h = (SimParams().startup_s + job[0].total_samples / rate) / 3600
    assert r["completed"] == 1 and r["jct_h"][0] == pytest.approx(expected_h, rel=1e-6)


def test_static_jobs_that_outgrow_their_memory_fail_after_the_restart_limit_dlrover_prevents_it():
    tp = replace(SMALL, n_jobs=20, misconfig={"low_memory": 1.0}, p_straggler=0.0, p_hot_server=0.0,
                 eviction_per_node_h=0.0)
    static, dl = run_comparison(tp, cluster=ClusterSpec(nodes=40), policies=("static", "dlrover"), seed=0)
    assert static["failures"].get("out of memory", 0) >= 15
    assert dl["completion_rate"] > static["completion_rate"] + 0.5


def test_cluster_placement_is_all_or_nothing_and_release_restores():
    c = Cluster(ClusterSpec(nodes=2, cpu_per_node=8, memory_per_node=16))
    where = c.place([(4, 4), (4, 4), (8, 8)])
    assert sorted(where) == [0, 0, 1] or sorted(where) == [0, 1, 1]
    assert c.place([(1, 1)]) is None and list(c.free_cpu) == [0, 0]
    c.release([(4, 4), (4, 4), (8, 8)], where)
    assert list(c.free_cpu) == [8, 8] and list(c.free_mem) == [16, 16] and c.free_cpu_total == 16
    assert c.place([(9, 1)]) is None and list(c.free_cpu) == [8, 8]


def test_truth_is_what_the_docstring_says():
    coef = {"a0": 0.02, "a1": 4e-4, "b1": 5e-5, "b2": 0.002, "b3": 0.001, "b4": 0.0005}
    t = truth.step_time(coef, 1.0, 512, 8, 4, 2, 4)
    assert t == pytest.approx(0.02 + 4e-4 * 512 / 4 + 5e-5 * 4 * 512 / 4 + 0.002 * 4 + 0.001 * 2 + 0.0005 * 8)
    assert truth.throughput(coef, 1.0, 512, 8, 4, 2, 4) == pytest.approx(8 * 512 / t)
    assert truth.throughput(coef, 1.0, 512, 8, 4, 2, 4, slow=4.0) == pytest.approx((7 + 0.25) * 512 / t)
    assert truth.throughput(coef, 0.8, 512, 8, 4, 2, 4, hot=2.0) < truth.throughput(coef, 0.8, 512, 8, 4, 2, 4)
    m = truth.server_memory_need(10e9, 1e6, 1000.0, 2)
    assert truth.samples_until_server_oom(10e9, 1000.0, 2, 1.0, m) == pytest.approx(1e6)


def test_trace_parameters_shape_the_trace():
    tr = generate_trace(replace(SMALL, n_jobs=400), seed=0)
    assert all(0 <= j.arrival_s <= SMALL.arrival_window_h * 3600 for j in tr)
    kinds = {j.misconfig for j in tr}
    assert kinds <= set(MISCONFIG)
    assert all(j.request["cpu_per_worker"] <= SMALL.max_pod_cpu for j in tr)
    assert sum(j.hot_server > 1 for j in tr) / len(tr) == pytest.approx(SMALL.p_hot_server, abs=0.06)
    assert len({j.scenario for j in tr}) <= SMALL.n_scenarios


def test_unknown_policy_names_are_rejected():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("kubernetes-hpa")
    with pytest.raises(ValueError, match="variant"):
        make_policy("dlrover-fast")
    assert make_policy("dlrover-nowarm").name == "dlrover-nowarm"


def test_cli_writes_table_json_and_plots(tmp_path):
    from typer.testing import CliRunner

    from recforge.cli import app

    res = CliRunner().invoke(app, ["simulate", "--jobs", "12", "--nodes", "4", "--seed", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "simulation.json").read_text())
    assert [p["policy"] for p in data["policies"]] == ["static", "optimus", "dlrover"]
    assert set(data["versus_static"]) == {"optimus", "dlrover"}
    assert (tmp_path / "jct_cdf.png").stat().st_size > 1000 and (tmp_path / "utilization.png").exists()
    bad = CliRunner().invoke(app, ["simulate", "--jobs", "5", "--policies", "nope"])
    assert bad.exit_code != 0
    huge = CliRunner().invoke(app, ["simulate", "--jobs", "1000000000", "--nodes", "10"])
    assert huge.exit_code != 0 and "available" in huge.output
