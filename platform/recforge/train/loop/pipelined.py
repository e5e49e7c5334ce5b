"""The step loop's sparse input dist overlapped with the previous step: TorchRec's `TrainPipelineSparseDist`.

The reference loop (torchrec_dlrm) starts the next batch's input all-to-all (the KJT's splits, lengths and values to
the ranks that hold the tables) before the current batch's forward, so with gloo the exchange runs on gloo's threads
while this rank computes, instead of at the start of every forward. recforge drives the same library pipeline over
PrefetchBatches' steps (accumulation 1; accumulation > 1 and sources without a prefetch thread keep the plain loop):

- `PipelinedStep` (torchrec `Pipelineable`) carries a step's tensors with its global real-row count `g_real` (known a
  step ahead: the prefetch thread all-reduces it) and the recforge `Batch` it came from (None: this rank had no data
  and trains the zero-weight batch).
- The pipeline traces `StepView` (the sharded DLRM, unwrapped: forward(step) = dlrm(step.dense, step.sparse)) to find
  the sharded EBC's input, and replaces that module's forward with TorchRec's PipelinedForward; each step runs
  through the DMP (`custom_model_fwd`: DDP's gradient all_reduce included) and recforge's exactly normalized loss
  (recforge.train.loop.loss.step_loss).
- `progress()` trains the oldest step in flight: zero_grad, start the next step's input dist, take the step after
  it from the source, forward, finish the next step's input dist, backward (the embedding optimizer fused in it),
  the dense optimizer step. Two steps are in flight after it (the next, its input dist done; the one after, read):
  they are not trained, so the loop reports them to the source (`trained`) only after their own `progress()`, and
  PrefetchBatches counts a step's rows in its progress (the checkpoint's data state) only then
  (`PrefetchBatches.defer_progress`): a checkpoint at a window boundary leaves them to be read again on resume.
- `detach()` at the epoch's end (or on any exception, a GroupStop included) gives the sharded EBC its own forward
  back, so evaluation, the probe and a later epoch see the plain model.

Switch: the trigger Param / config field train.sparse_dist_pipeline, off by default (env RECFORGE_TRAIN_PIPELINE=1 / 0
on the workers overrides it, for benchmarks). Measured on the 2-core benchmark machine it did not pay: the pipeline's
own CPU per step (~1-2.5 ms on the loop thread) outweighed the all-to-all wait it hides (bench_train_peer's
recforge_pipelined side; docs/performance.md#training-against-torchrecs-reference-loop, "Seventh session").
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from recforge.train.loop.batches import Batch
from recforge.train.loop.loss import step_loss

PIPELINE_ENV = "RECFORGE_TRAIN_PIPELINE"


def pipeline_override(env: dict[str, str] | None = None) -> bool | None:
    """Env RECFORGE_TRAIN_PIPELINE (1 / 0), which overrides train.sparse_dist_pipeline for a job (benchmarks):
    None when unset; ValueError naming the variable on any other value."""
    raw = (os.environ if env is None else env).get(PIPELINE_ENV, "").strip().lower()
    if not raw:
        return None
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{PIPELINE_ENV}={raw!r}: expected 1 or 0 (the pipelined step loop on or off)")


@dataclass
class PipelinedStep(Pipelineable):
    """One step's batch as the pipeline moves it: the model's inputs, the loss's labels / weights / global weight,
    and the recforge Batch to report trained (None: this rank's zero-weight batch)."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor
    g_real: float
    real: int
    batch: Batch | None

    @classmethod
    def of(cls, batch: Batch | None, empty: Batch, g_real: float) -> PipelinedStep:
        b = batch if batch is not None else empty
        return cls(dense=b.dense, sparse=b.sparse, labels=b.labels, weights=b.weights, g_real=float(g_real),
                   real=batch.real if batch is not None else 0, batch=batch)

    def to(self, device: torch.device, non_blocking: bool = False) -> PipelinedStep:
        if self.dense.device == torch.device(device):
            return self  # CPU training: nothing to move
        return PipelinedStep(dense=self.dense.to(device, non_blocking=non_blocking),
                             sparse=self.sparse.to(device, non_blocking=non_blocking),
                             labels=self.labels.to(device, non_blocking=non_blocking),
                             weights=self.weights.to(device, non_blocking=non_blocking), g_real=self.g_real,
                             real=self.real, batch=self.batch)

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.dense, self.labels, self.weights):
            t.record_stream(stream)
        self.sparse.record_stream(stream)


class StepView(torch.nn.Module):
    """What the pipeline traces: the sharded DLRM (DMP's module, unwrapped) called on a PipelinedStep's fields, so
    the sharded EBC's input is found as `step.sparse`. The step itself runs through the DMP (see StepPipeline)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, step: PipelinedStep) -> torch.Tensor:
        return self.inner(step.dense, step.sparse)


Mark = Callable[[str], None]


class StepPipeline(TrainPipelineSparseDist):
    """TrainPipelineSparseDist over recforge's sharded DLRM and loss. `progress(steps)` returns
    (logits detached, this rank's weighted BCE sum detached, the PipelinedStep trained). `mark(phase)` (PhaseTimes)
    is charged: input_dist (the next step's input dist started / finished, zero_grad), forward, backward,
    optimizer; the source's iterator charges its own wait as data."""

    def __init__(self, dmp: DistributedModelParallel, optimizer: Any, *, world_size: int,
                 mark: Mark | None = None,
                 quiet: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> None:
        if not isinstance(dmp, DistributedModelParallel):
            raise TypeError(f"StepPipeline: the model must be a DistributedModelParallel, got {type(dmp).__name__}")
        self.dmp, self.world_size = dmp, world_size
        self.mark: Mark = mark if mark is not None else (lambda phase: None)
        self.quiet = quiet if quiet is not None else contextlib.nullcontext
        view = StepView(dmp.module)
        view.train(dmp.training)
        device = next((p.device for p in dmp.parameters()), torch.device("cpu"))
        super().__init__(view, optimizer, device, execute_all_batches=True, custom_model_fwd=self._step_forward)

    def _pipeline_model(self, batch: Any, context: Any, pipelined_forward: Any = PipelinedForward) -> None:
        """The library's model rewrite (an fx trace of StepView, once per pipeline) under `quiet()`: fx patches
        nn.Module calls process-wide while tracing, so the prefetch thread is held meanwhile
        (PrefetchBatches.paused)."""
        with self.quiet():
            super()._pipeline_model(batch, context, pipelined_forward)

    def detach(self) -> torch.nn.Module:
        """The library's detach (the sharded modules' and their KJT all-to-alls' own forwards back), then the
        instance attributes it leaves dropped: the modules are as before the pipeline (a later one traces them anew)."""
        modules = list(self._pipelined_modules)
        out = super().detach()
        for mod in modules:
            vars(mod).pop("forward", None)
            for child in mod.modules():
                for input_dist in getattr(child, "_input_dists", None) or []:
                    if hasattr(input_dist, "_dist"):
                        vars(input_dist._dist).pop("forward", None)
            mod.is_pipelined = False
        return out

    def _step_forward(self, step: PipelinedStep | None) -> tuple[torch.Tensor, Any]:
        if step is None:
            raise RuntimeError("StepPipeline: the pipeline ran a forward without a step")
        self.mark("input_dist")
        logits = self.dmp(step.dense, step.sparse)
        loss, local_sum = step_loss(logits, step.labels, step.weights, step.g_real, self.world_size)
        self.mark("forward")
        return loss, (logits.detach(), local_sum, step)

    def _backward(self, losses: torch.Tensor) -> None:
        self.mark("input_dist")  # the next step's input dist finished after this step's forward
        losses.backward()
        self.mark("backward")

    def _optimizer_step(self) -> None:
        self._optimizer.step()
        self.mark("optimizer")


def step_iterator(next_step: Callable[[], Any], empty: Batch, mark: Mark | None = None) -> Iterator[PipelinedStep]:
    """PrefetchBatches.next_step's steps (accumulation 1) as PipelinedSteps until the epoch ends on every rank;
    the wait for each is charged to `data`."""
    mark = mark if mark is not None else (lambda phase: None)
    while True:
        mark("input_dist")
        step = next_step()
        mark("data")
        if step is None:
            return
        if len(step.micro) != 1:
            raise ValueError(f"the pipelined loop takes one batch per step, the source's steps have {len(step.micro)}")
        yield PipelinedStep.of(step.micro[0], empty, step.g_real)
