"""FusedEmbeddingLayer: the compiled embedding layer as an nn.Module over the fused op.

It holds the plan's buffers (packed tables, boundaries, metadata) and, per call, picks the op's inputs
out of the model's flattened inputs and calls ``torch.ops.recforge.embedding_layer`` once.

Bad input at run time behaves as eager: an id outside its table (in a column whose ids are not proven in
range) raises ``LookupIndexError``, an IndexError and a RuntimeError at once (eager's ``embedding`` raises
the one, ``embedding_bag`` the other), naming the column and the id; lengths that do not match the values
raise ValueError. Nothing is read outside a table, an input or the workspace.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor, nn

import recforge_kernels.embedding_op  # noqa: F401  (registers torch.ops.recforge.embedding_layer)
from recforge.recom.backend.embedding_plan import EmbeddingPlan
from recforge.recom.errors import LookupIndexError


class FusedEmbeddingLayer(nn.Module):
    """forward(flat_inputs) -> float32[B, total_dim]; ``input_index[k]`` is the flat position of op input k."""

    # buffers, registered in __init__
    weights: Tensor
    fbuf: Tensor
    ibuf: Tensor
    meta: Tensor

    def __init__(self, weights: Tensor, fbuf: Tensor, ibuf: Tensor, meta: Tensor, total_dim: int,
                 input_index: list[int], batch_index: int, column_names: list[str]):
        super().__init__()
        self.register_buffer("weights", weights)
        self.register_buffer("fbuf", fbuf)
        self.register_buffer("ibuf", ibuf)
        self.register_buffer("meta", meta)
        self.total_dim = int(total_dim)
        self.input_index = [int(i) for i in input_index]
        self.batch_index = int(batch_index)
        self.column_names = list(column_names)  # metadata row order

    @classmethod
    def from_plan(cls, plan: EmbeddingPlan, flat_names: list[str]) -> FusedEmbeddingLayer:
        pos = {n: i for i, n in enumerate(flat_names)}
        return cls(plan.weights, plan.fbuf, plan.ibuf, plan.meta, plan.total_dim,
                   [pos[n] for n in plan.input_names], pos[plan.batch_input], [p.name for p in plan.programs])

    @property
    def num_columns(self) -> int:
        return int(self.meta.shape[0])

    def config(self) -> dict:
        return {"total_dim": self.total_dim, "input_index": self.input_index, "batch_index": self.batch_index,
                "column_names": self.column_names}

    def forward(self, flat_inputs: list[Tensor]) -> Tensor:
        inputs = [flat_inputs[i] for i in self.input_index]
        batch = flat_inputs[self.batch_index].shape[0]
        try:
            return torch.ops.recforge.embedding_layer(inputs, self.weights, self.fbuf, self.ibuf, self.meta, batch,
                                                      self.total_dim)
        except IndexError as e:
            raise LookupIndexError(_name_column(str(e), self.column_names)) from None
        except ValueError as e:
            raise type(e)(_name_column(str(e), self.column_names)) from None


def _name_column(message: str, names: list[str]) -> str:
    """The kernel numbers columns by metadata row; say which column of the model that is."""
    m = re.search(r"column (\d+)", message)
    if m and int(m.group(1)) < len(names):
        return f"{message} (column {names[int(m.group(1))]!r})"
    return message
