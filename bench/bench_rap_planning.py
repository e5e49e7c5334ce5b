"""RAP planning numbers: cost-model accuracy on our fused executor, the simulator on the artifact's published
profile, and the mapping MILP (solve time, imbalance before / after).

    python bench/bench_rap_planning.py [--threads 1] [--repeats 7]

1. cost model: measures the fused executor (recforge.rap.profiling.cost_probe) over ops x fusion degree x rows x width,
   fits, prints the share of held-out predictions within 10% (overall and per op).
2. simulator: plan 0, 4 GPUs, local batch 4096, GPU 0 stages 0.93 1.92 2.86 0.99 1.37 ms, capacities 24 28 52 30
   64 proxy units (docs/rap.md), the artifact's table placement; kernel costs scaled to its 0.49 ms for GPU 0;
   prints every method's iteration time and where RAP placed the work; writes the Gantt PNG.
3. mapping: plan 0 tables (Criteo Kaggle cardinalities, dim 128) on 4 and 8 ranks; before = the artifact's placement
   (4 ranks) or round robin (8); after = the MILP; with the artifact's capacity, a tenth and a fiftieth of it.
Writes bench/results/bench_rap_planning_<UTC time>.json and the PNG beside it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path

import torch

from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.presets import load_plan
from recforge.rap.mapping.milp import milp as mapping
from recforge.rap.planning import gantt, simulator
from recforge.rap.profiling import cost_model, cost_probe
from recforge.rap.profiling.stages import STAGES

RESULTS = Path(__file__).resolve().parent / "results"
STAGE_MS = dict(zip(STAGES, [0.93, 1.92, 2.86, 0.99, 1.37], strict=True))
UNITS = dict(zip(STAGES, [24, 28, 52, 30, 64], strict=True))
TABLE_MAPPING_4 = [1, 1, 3, 2, 2, 2, 3, 1, 1, 3, 1, 3, 0, 0, 1, 3, 1, 2, 3, 0, 0, 2, 2, 0, 0, 2, 0]
ARTIFACT_LIKE = cost_model.CostModel({op: [0.02, 0.0, 8.5e-7, 0.0, 0.0]
                                      for op in ("fill_null", "logit", "sigrid_hash", "firstx", "bucketize")})
UNIT_MS = 1.35 * STAGE_MS["allreduce"] / UNITS["allreduce"]  # docs/rap.md: grad_comm C/tau 1.2-1.5


def bench_cost_model(threads: int, repeats: int) -> dict:
    data = cost_probe.measure(degrees=(1, 2, 4, 8, 16, 32), rows=(256, 1024, 4096, 16384), widths=(1, 2, 4, 8),
                              repeats=repeats, threads=threads)
    _, report = cost_model.fit(data, holdout=0.2)
    print(f"cost model: {report['measurements']} measurements, held-out within 10%: "
          f"{report['heldout_within_10pct']:.1%} of {report['heldout_n']}")
    for op, acc in report["heldout_within_10pct_by_op"].items():
        print(f"  {op:20s} {acc:.0%}")
    return report


def bench_simulator(out_png: Path) -> dict:
    plan = load_plan("plan0")
    placements = {f: mapping.Placement("table_wise", (r,))
                  for f, r in zip(plan.sparse_features(), TABLE_MAPPING_4, strict=True)}
    rank = simulator.RankStages(STAGE_MS, {s: u * UNIT_MS for s, u in UNITS.items()})
    setup = simulator.SimSetup(plan=plan, placements=placements, batch_size=4096, ranks=[rank] * 4,
                               kernel_cost=simulator.cost_model_kernel_cost(ARTIFACT_LIKE), input_comm_ms=0.3)
    sim = simulator.simulate(setup)
    speed = sim.throughput_vs("sequential")
    print("simulator, artifact profile (plan 0, 4 GPUs, B 4096; input all-to-all 0.3 ms assumed):")
    rows = {}
    for m, r in sim.methods.items():
        rows[m] = {"iteration_ms": r.iteration_ms, "speedup_vs_sequential": speed[m],
                   "vs_ideal": r.iteration_ms / sim.methods["ideal"].iteration_ms - 1, "gpu0_prep_ms": r.prep_ms[0]}
        print(f"  {m:15s} {r.iteration_ms:7.3f} ms  x{speed[m]:.2f} vs sequential  "
              f"{rows[m]['vs_ideal']:+.2%} vs ideal  GPU0 preprocessing {r.prep_ms[0]:.3f} ms")
    gpu0 = sim.schedules[0]
    placed = {s: [a.group for a in items] for s, items in gpu0.by_stage().items() if items}
    print(f"  RAP GPU 0 placement: {placed}")
    gantt.save_png(gpu0, STAGE_MS, rank.capacity_ms, out_png, title="RAP plan 0, GPU 0 (artifact profile)")
    return {"methods": rows, "gpu0_placement": placed, "schedule_gpu0": json.loads(gpu0.to_json())}


def _tables(plan, world: int, batch: int) -> list[mapping.TableLoad]:
    compiled = compile_plan(plan, method="greedy")
    per_feature = {}
    for f in plan.sparse_features():  # marginal preprocessing of one feature's chain (no launch cost)
        node = compiled.graph.outputs[f]
        chain = []
        while node is not None:
            chain.append(compiled.graph.nodes[node])
            node = compiled.graph.nodes[node].parent
        per_feature[f] = sum(ARTIFACT_LIKE.coef[n.op][2] for n in chain)
    return [mapping.TableLoad(f, rows, 128, per_feature[f] * world * batch, per_feature[f] * batch)
            for f, rows in plan.tables()]


def bench_mapping() -> dict:
    plan = load_plan("plan0")
    out = {}
    for world in (4, 8):
        tables = _tables(plan, world, 4096)
        emb_values = 7 * world * 4096 * 128  # GPU 0's share in the artifact: 7 tables
        lookup = (STAGE_MS["emb_fwd"] + STAGE_MS["emb_bwd"]) / emb_values
        for cap_scale in (1.0, 0.1, 0.02):
            capacity = cap_scale * sum(UNITS.values()) * UNIT_MS
            costs = mapping.MappingCosts(
                world_size=world, batch_size=4096,
                base_ms=STAGE_MS["mlp_fwd"] + STAGE_MS["mlp_bwd"] + STAGE_MS["allreduce"],
                lookup_ms_per_value=lookup, allreduce_ms_per_value=1.37 / 2.5e6, dense_prep_ms=0.2,
                capacity_ms=[capacity] * world, memory_values=40e9 / 4 / 2, table_overhead_ms=0.01)
            before = ({f: mapping.Placement("table_wise", (r,))
                       for f, r in zip(plan.sparse_features(), TABLE_MAPPING_4, strict=True)}
                      if world == 4 else
                      {f: mapping.Placement("table_wise", (i % world,)) for i, f in enumerate(plan.sparse_features())})
            t_before = mapping.evaluate(tables, before, costs)
            res = mapping.solve(tables, costs)
            kinds = {}
            for p in res.placements.values():
                kinds[p.kind] = kinds.get(p.kind, 0) + 1
            key = f"world{world}_capacity{cap_scale}"
            out[key] = {"solve_s": res.solve_s, "binaries": res.candidates,
                        "before_max_ms": max(t_before.step_ms), "before_imbalance": t_before.imbalance,
                        "after_max_ms": max(res.times.step_ms), "after_imbalance": res.times.imbalance,
                        "placement_kinds": kinds, "before_unhidden_ms": t_before.unhidden_ms,
                        "after_unhidden_ms": res.times.unhidden_ms}
            print(f"mapping {key}: {res.candidates} binaries, HiGHS {res.solve_s * 1e3:.0f} ms; max step "
                  f"{max(t_before.step_ms):.3f} -> {max(res.times.step_ms):.3f} ms, imbalance "
                  f"{t_before.imbalance:.2%} -> {res.times.imbalance:.2%}; placements {kinds}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    result = {"threads": args.threads, "load_avg": os.getloadavg(),
              "cost_model": bench_cost_model(args.threads, args.repeats),
              "simulator": bench_simulator(RESULTS / f"bench_rap_planning_{stamp}_gantt.png"),
              "mapping": bench_mapping()}
    path = RESULTS / f"bench_rap_planning_{stamp}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
