"""PhaseTimes charges wall and CPU time per phase: a wait is wall time without CPU, work is both."""
from __future__ import annotations

import time

from recforge.train.loop.step_loop import PHASES, PhaseTimes


def test_wait_is_wall_not_cpu_and_work_is_cpu():
    pt = PhaseTimes()
    time.sleep(0.05)
    pt.mark("data")  # a wait: a rank blocked on a collective or the prefetch queue
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < 0.03:  # 30 ms of this thread's CPU, however loaded the machine is
        x += 1
    pt.mark("forward")
    d = pt.to_dict()
    assert d["data_s"] >= 0.05 and d["data_cpu_s"] < d["data_s"] / 2
    assert d["forward_cpu_s"] >= 0.03 and d["forward_s"] >= d["forward_cpu_s"] - 1e-3
    assert set(d) == {"steps", *(f"{p}_s" for p in PHASES), *(f"{p}_cpu_s" for p in PHASES)}


def test_restart_drops_the_time_before_it():
    pt = PhaseTimes()
    time.sleep(0.03)
    pt.restart()
    pt.mark("optimizer")
    assert pt.seconds["optimizer"] < 0.03 and pt.cpu_seconds["optimizer"] < 0.03
