"""A worker applies train.gil_switch_interval_ms to its Python thread switch interval (sys.setswitchinterval), in
the real worker entry point; a bad value is refused by the config, naming the field."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from recforge.config import TrainConfig

# the worker's own function, on a spec-like object holding a real TrainConfig
PROBE = r"""
import sys, types
from recforge.config import TrainConfig
from recforge.worker.main import apply_switch_interval
print(sys.getswitchinterval())
apply_switch_interval(types.SimpleNamespace(train=TrainConfig(**eval(sys.argv[1]))))
print(sys.getswitchinterval())
"""


def _run(train_kwargs: dict) -> list[float]:
    out = subprocess.run([sys.executable, "-c", PROBE, repr(train_kwargs)], capture_output=True, text=True,
                         timeout=120, check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    return [float(x) for x in out.split()]


def test_the_default_is_half_a_millisecond_not_cpythons_5_ms():
    before, after = _run({})
    assert before == pytest.approx(0.005)
    assert after == pytest.approx(0.0005)


def test_a_configured_interval_is_applied():
    assert _run({"gil_switch_interval_ms": 2.0})[1] == pytest.approx(0.002)


@pytest.mark.parametrize("bad", [0.0, -1.0, 101.0])
def test_a_bad_interval_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError, match="gil_switch_interval_ms"):
        TrainConfig(gil_switch_interval_ms=bad)
