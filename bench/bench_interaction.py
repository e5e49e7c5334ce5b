"""DLRM's dot interaction, forward + backward, side by side: torchrec's InteractionArch (eager, and under
torch.compile), recforge's torch path (recforge_kernels.interaction.dot_interaction_torch) and its C++ kernel.

One process, one intra-op thread, the same inputs for every side; rounds interleave the sides; medians of the
per-call times (forward, backward, both) and each side's ratio to torchrec eager. Values are checked against
torchrec's before timing (a side that disagrees is reported, not timed).

    python bench/bench_interaction.py --batch 512 --features 26 --dim 16 --rounds 7
    recforge bench interaction -- --rounds 7
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from _results import cpu_model, time_forward_backward, write_report  # bench/_results.py

RESULTS = Path(__file__).resolve().parent / "results"
SIDES = ("torchrec", "torchrec_compiled", "recforge_torch", "recforge_cpp")


def make_side(name: str, features: int):
    """forward(dense, sparse) -> output for side `name`."""
    from torchrec.models.dlrm import InteractionArch

    from recforge_kernels import interaction as inter

    arch = InteractionArch(features)
    if name == "torchrec":
        return arch
    if name == "torchrec_compiled":
        return torch.compile(arch, dynamic=False)
    if name == "recforge_torch":
        return inter.dot_interaction_torch
    if name == "recforge_cpp":
        if inter.extension() is None:
            raise RuntimeError(f"the C++ kernel is not available: {inter.status()}")
        return inter.dot_interaction
    raise ValueError(f"unknown side {name!r}")


def time_side(fn, dense: torch.Tensor, sparse: torch.Tensor, grad: torch.Tensor, calls: int) -> dict[str, float]:
    """Median seconds of forward and backward over `calls` calls (torch.autograd.grad, not .backward: no .grad
    accumulation timed)."""
    return time_forward_backward(range(calls), lambda _: fn(dense, sparse),
                                 lambda _, out: torch.autograd.grad(out, (dense, sparse), grad))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--features", type=int, default=26, help="sparse features F (the interaction has F + 1 vectors)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50, help="timed calls per side and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_interaction.json")
    args = ap.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        ap.error(f"--sides: expected some of {', '.join(SIDES)}, got {args.sides!r}")
    if min(args.batch, args.features, args.dim, args.rounds, args.calls, args.threads) < 1:
        ap.error("--batch, --features, --dim, --rounds, --calls and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(args.batch, args.dim, generator=g, requires_grad=True)
    sparse = torch.randn(args.batch, args.features, args.dim, generator=g, requires_grad=True)
    fns = {s: make_side(s, args.features) for s in sides}
    want = make_side("torchrec", args.features)(dense, sparse)
    grad = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad(want, (dense, sparse), grad)
    disagree: dict[str, str] = {}
    for s, fn in list(fns.items()):
        for _ in range(3):  # warm-up (torch.compile compiles here) and the check
            out = fn(dense, sparse)
        got_grads = torch.autograd.grad(out, (dense, sparse), grad)
        try:
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
            for a, b in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        except AssertionError as e:
            disagree[s] = str(e).splitlines()[0]
            del fns[s]
    rounds: list[dict[str, Any]] = []
    with Progress() as bar:
        task = bar.add_task("rounds", total=args.rounds * len(fns))
        for _ in range(args.rounds):
            rnd = {}
            for s, fn in fns.items():
                rnd[s] = time_side(fn, dense, sparse, grad, args.calls)
                bar.advance(task)
            rounds.append(rnd)
    median = {s: {k: statistics.median(r[s][k] for r in rounds) for k in ("forward_s", "backward_s", "total_s")}
              for s in fns}
    base = median.get("torchrec")
    report = {"bench": "interaction", "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "rounds": rounds, "median": median, "disagree": disagree,
              "speedup_vs_torchrec": ({s: base["total_s"] / m["total_s"] for s, m in median.items()} if base else {})}
    for s, m in median.items():
        ratio = f"  {base['total_s'] / m['total_s']:.2f}x torchrec" if base else ""
        print(f"{s:18s} forward {m['forward_s'] * 1e3:7.3f} ms  backward {m['backward_s'] * 1e3:7.3f} ms{ratio}")
    for s, why in disagree.items():
        print(f"{s}: values differ from torchrec's, not timed: {why}", file=sys.stderr)
    write_report(args.out, report)
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
