"""`preprocessing: auto`: co-run or inline, decided from RAP's predicted iteration times of the job.

    choice = choose_by_bound("auto", StepBound(train_lb_ms=..., inline_prep_ms=...))  # cold: before profiling
    choice = choice or choose_mode("auto", ModePredictions(train_ms=..., inline_prep_ms=..., corun_ms=..., ...))

Pure: the bound and the predictions are measured by pipelines/hooks/rap_planning.py (a training step on one rank;
the job's stage profile and timed kernels). Design and what a 2-core CPU measures: docs/rap.md#preprocessing-auto.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("inline", "corun", "offline")  # what a worker runs
REQUESTS = ("auto", *MODES)  # what the config may ask for
CORUN_MARGIN = 0.05  # co-run must be predicted at least this much faster than inline (stage medians move ~5%)


@dataclass(frozen=True)
class ModePredictions:
    """One iteration of the job as RAP predicts it, in ms.

    train_ms: the profiled training stages summed (training alone, ready batches);
    inline_prep_ms: the job's executor over one local batch in the trainer's thread (serial with the step);
    corun_ms: the simulator's RAP iteration (stages + the preprocessing their spare capacity does not hide);
    corun_kernel_ms: the fused kernels co-run per iteration (the slowest rank's); capacity_ms: the stages' spare
    capacity summed; mapping: corun_ms assumes RAP's mapping (2+ workers)."""

    train_ms: float
    inline_prep_ms: float
    corun_ms: float
    corun_kernel_ms: float | None = None
    capacity_ms: float | None = None
    mapping: bool = False

    def __post_init__(self) -> None:
        for name in ("train_ms", "inline_prep_ms", "corun_ms", "corun_kernel_ms", "capacity_ms"):
            v = getattr(self, name)
            if v is None and name in ("corun_kernel_ms", "capacity_ms"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ModePredictions.{name}: must be a finite number >= 0, got {v!r}")
        if self.train_ms <= 0:
            raise ValueError(f"ModePredictions.train_ms: the profiled stages must take time, got {self.train_ms!r}")

    @property
    def inline_ms(self) -> float:
        return self.train_ms + self.inline_prep_ms


@dataclass(frozen=True)
class StepBound:
    """What a cold `auto` decision measures before profiling, in ms. train_lb_ms: a lower bound of the profiled
    training stages summed (ModePredictions.train_ms); inline_prep_ms: as ModePredictions.inline_prep_ms."""

    train_lb_ms: float
    inline_prep_ms: float

    def __post_init__(self) -> None:
        for name in ("train_lb_ms", "inline_prep_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"StepBound.{name}: must be a finite number >= 0, got {v!r}")
        if self.train_lb_ms <= 0:
            raise ValueError(f"StepBound.train_lb_ms: a training step takes time, got {self.train_lb_ms!r}")

    @property
    def max_corun_saving(self) -> float:
        return corun_saving_bound(self.train_lb_ms, self.inline_prep_ms)


def corun_saving_bound(train_lb_ms: float, inline_prep_ms: float) -> float:
    """The most co-run can be predicted to save over inline, a fraction of inline's iteration: co-run's iteration is
    the training stages plus what they do not hide (never below train_ms), inline's train_ms + prep, so the saving
    is at most prep / (train_ms + prep); that grows as train_ms shrinks, so a lower bound of it gives an upper bound."""
    return inline_prep_ms / (train_lb_ms + inline_prep_ms)


@dataclass(frozen=True)
class ModeChoice:
    """bound: 'auto' decided by choose_by_bound, not profiled; both predictions are then lower bounds."""

    requested: str
    mode: str
    reason: str
    predicted_inline_ms: float | None = None
    predicted_corun_ms: float | None = None
    bound: bool = False


def _check(requested: str, margin: float) -> None:
    if requested not in REQUESTS:
        raise ValueError(f"preprocessing: {requested!r} is not one of {list(REQUESTS)}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"preprocessing auto: margin must be a fraction in [0, 1), got {margin!r}")


def choose_by_bound(requested: str, bound: StepBound, margin: float = CORUN_MARGIN) -> ModeChoice | None:
    """'auto' before profiling: inline when co-run could not be predicted more than `margin` faster even hiding all
    the preprocessing (choose_mode picks inline for every profile with train_ms >= bound.train_lb_ms); None when it
    could (profile the job) or for an explicit request (kept; corun is profiled). The predictions recorded are lower
    bounds: inline train_lb + prep, co-run train_lb."""
    _check(requested, margin)
    if requested != "auto":
        return None
    # choose_mode over the profile most favourable to co-run that the bound allows: the shortest training, all the
    # preprocessing hidden (the same comparison, so the edge is decided as choose_mode decides it)
    best = ModePredictions(train_ms=bound.train_lb_ms, inline_prep_ms=bound.inline_prep_ms, corun_ms=bound.train_lb_ms)
    if choose_mode("auto", best, margin).mode == "corun":
        return None
    at_most = bound.max_corun_saving
    return ModeChoice("auto", "inline",
                      f"auto: preprocessing {bound.inline_prep_ms:.3f} ms of a >= {bound.train_lb_ms:.1f} ms "
                      f"training step: co-run could save at most {at_most:.2%}, not more than the {margin:.0%} "
                      "margin; not profiled",
                      round(bound.train_lb_ms + bound.inline_prep_ms, 4), round(bound.train_lb_ms, 4), bound=True)


def choose_mode(requested: str, predictions: ModePredictions | None = None,
                margin: float = CORUN_MARGIN) -> ModeChoice:
    """The mode the workers run. An explicit mode is kept ("configured"); 'auto' needs `predictions` and picks
    corun only when its predicted iteration is more than `margin` (a fraction) below inline's, else inline."""
    _check(requested, margin)
    inline = round(predictions.inline_ms, 4) if predictions is not None else None
    corun = round(predictions.corun_ms, 4) if predictions is not None else None
    if requested != "auto":
        return ModeChoice(requested, requested, "configured", inline, corun)
    if predictions is None:
        raise ValueError("preprocessing 'auto': needs the predicted iteration times of inline and co-run "
                         "(the job's stage profile)")
    p = predictions
    gain = 1.0 - p.corun_ms / p.inline_ms
    how = "co-run with RAP's mapping" if p.mapping else "co-run"
    compared = (f"{how} {p.corun_ms:.3f} ms vs inline {p.inline_ms:.3f} ms per iteration "
                f"(training {p.train_ms:.3f} + preprocessing {p.inline_prep_ms:.3f} ms)")
    hidden = ""
    if p.corun_kernel_ms is not None and p.capacity_ms is not None:
        hidden = (f"; the stages' spare capacity {p.capacity_ms:.3f} ms against {p.corun_kernel_ms:.3f} ms "
                  "of fused kernels")
    if p.corun_ms < p.inline_ms * (1.0 - margin):
        return ModeChoice("auto", "corun", f"auto: corun predicted {gain:.1%} faster, more than the {margin:.0%} "
                          f"margin: {compared}{hidden}", inline, corun)
    why = "slower than" if gain < 0 else f"only {gain:.1%} faster than, within the {margin:.0%} margin of,"
    return ModeChoice("auto", "inline", f"auto: corun predicted {why} inline: {compared}{hidden}", inline, corun)
