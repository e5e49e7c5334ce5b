"""RAP's five stages of one training iteration, and a tracker that sees their boundaries through hooks.

`STAGES` lists them in execution order; `StageTracker` calls back at every boundary and times every step. The
co-run runtime and the stage profiler depend on this API. Where each boundary falls in TorchRec's DLRM:
docs/rap.md#the-five-stages-in-torchrecs-dlrm.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

STAGES: tuple[str, ...] = ("emb_fwd", "mlp_fwd", "mlp_bwd", "emb_bwd", "allreduce")

StageCallback = Callable[[str], None]


class StageOrderError(RuntimeError):
    """A stage boundary fired out of RAP's order (e.g. a step_end without a backward)."""


@dataclass
class StepTiming:
    wall_ms: dict[str, float] = field(default_factory=dict)
    cuda_ms: dict[str, float] | None = None

    @property
    def ms(self) -> dict[str, float]:
        """CUDA event times where recorded, else wall clock."""
        return self.cuda_ms if self.cuda_ms is not None else self.wall_ms

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The DLRM inside DMP (DMP.module strips DMP and DDP)."""
    inner: torch.nn.Module | None = model
    for _ in range(4):
        if inner is None:
            break
        if hasattr(inner, "sparse_arch"):
            return inner
        inner = getattr(inner, "module", None)
    raise TypeError(f"StageTracker: {type(model).__name__} has no sparse_arch: expected a torchrec DLRM "
                    "(bare or in DistributedModelParallel)")


class StageTracker:
    """Hooks on a TorchRec DLRM / DLRM_DCN (bare or in DistributedModelParallel) that find RAP's stage boundaries.

    `on_enter(stage)` / `on_exit(stage)` are called synchronously, once per stage and step, in STAGES order. The
    emb_fwd / mlp_fwd boundaries run in the training thread, the others inside the autograd engine (on CUDA its
    device thread): keep callbacks short and non-blocking (set an event, record a CUDA event); an exception in one
    propagates into the step. `cuda_events`: None records torch.cuda.Event pairs when the model's parameters are
    on CUDA, False never. `steps` holds the completed steps' StepTiming, `stage` the current stage (None between
    steps). A forward without grad, or in eval mode, is ignored; a boundary out of order raises StageOrderError.
    The trainer's step::

        tracker.step_begin()          # optional
        logits = model(dense, kjt)    # hooks: emb_fwd -> mlp_fwd
        loss = ...                    # still mlp_fwd
        loss.backward()               # hooks: mlp_bwd -> emb_bwd -> allreduce
        opt.step(); opt.zero_grad()   # allreduce
        tracker.step_end()
    """

    def __init__(self, model: torch.nn.Module, on_enter: StageCallback | None = None,
                 on_exit: StageCallback | None = None, cuda_events: bool | None = None) -> None:
        self.model = _unwrap(model)
        self.on_enter, self.on_exit, self.cuda_events = on_enter, on_exit, cuda_events
        self.steps: list[StepTiming] = []
        self.stage: str | None = None
        self._t: list[float] = []
        self._events: list = []
        self._use_cuda = False
        self._handles = [
            self.model.register_forward_pre_hook(self._on_model_pre),
            self.model.register_forward_hook(self._on_model_out),
            self.model.sparse_arch.register_forward_hook(  # type: ignore[union-attr]  # nn.Module.__getattr__: Tensor | Module
                self._on_sparse_out),
        ]

    # ----------------------------------------------------------------- trainer calls

    def step_begin(self) -> None:
        """Open the step (enter emb_fwd) before the model's forward, e.g. to count the input copy. Optional: without
        it the model's forward pre-hook opens the step."""
        if self.stage == STAGES[-1]:
            self.step_end()
        if self.stage is not None:
            raise StageOrderError(f"step_begin while the step is in {self.stage!r}: call step_end first")
        self._enter(0)

    def step_end(self) -> StepTiming:
        """Close allreduce and return the step's StepTiming. Required after the optimizer step: hooks cannot see
        the optimizer. With gradient accumulation each micro-batch is a step: a forward (or step_begin) after a
        finished backward closes the previous one. On CUDA it synchronizes on the step's last event."""
        if self.stage != STAGES[-1]:
            raise StageOrderError(f"step_end in stage {self.stage!r}: expected 'allreduce' (did backward run "
                                  "with this tracker attached?)")
        self._mark()
        self._exit_current()
        timing = StepTiming(wall_ms={s: (self._t[i + 1] - self._t[i]) * 1e3 for i, s in enumerate(STAGES)})
        if self._use_cuda:
            self._events[-1].synchronize()
            timing.cuda_ms = {s: self._events[i].elapsed_time(self._events[i + 1]) for i, s in enumerate(STAGES)}
        self.steps.append(timing)
        self.stage = None
        return timing

    def detach(self) -> None:
        """Remove every hook; the model is as before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stage = None

    # ----------------------------------------------------------------- boundaries

    def _mark(self) -> None:
        self._t.append(time.perf_counter())
        if self._use_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append(ev)

    def _exit_current(self) -> None:
        if self.on_exit is not None and self.stage is not None:  # a stage is open whenever one is exited
            self.on_exit(self.stage)

    def _enter(self, index: int) -> None:
        stage = STAGES[index]
        if index == 0:
            self._t, self._events = [], []
            self._use_cuda = self.cuda_events is not False and torch.cuda.is_available() and \
                any(p.is_cuda for p in self.model.parameters())
        elif self.stage != STAGES[index - 1]:
            raise StageOrderError(f"stage {stage!r} began while the step is in {self.stage!r}; "
                                  f"expected {STAGES[index - 1]!r}")
        if index > 0:
            self._exit_current()
        self._mark()
        self.stage = stage
        if self.on_enter is not None:
            self.on_enter(stage)

    def _active(self) -> bool:
        return self.model.training and torch.is_grad_enabled()

    def _on_model_pre(self, module, args) -> None:
        if not self._active():
            return
        if self.stage == STAGES[-1]:  # a micro-batch's backward is done: gradient accumulation
            self.step_end()
        if self.stage is None:
            self._enter(0)

    def _on_sparse_out(self, module, args, out) -> None:
        if not self._active() or self.stage is None:
            return
        self._enter(1)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._enter(3))

    def _on_model_out(self, module, args, out) -> None:
        if not self._active() or self.stage is None:
            return
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            raise StageOrderError("mlp_bwd: the model output does not require grad; the tracker cannot see backward")
        out.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad):
        self._enter(2)
        # queued before DDP's finalize callback (DDP queues its own at the first parameter gradient, later),
        # so it marks the end of backward computation, before the wait for the gradient all-reduce.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._enter(4))
        return grad
