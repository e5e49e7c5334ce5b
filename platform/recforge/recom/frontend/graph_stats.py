"""Op counting: what a forward dispatches eagerly, and what an exported graph holds."""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that read embedding rows (pooled or not): RECom's "lookups".
LOOKUP_OPS = ("embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")


def _op_name(target: object) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # "aten.embedding.default"
    return getattr(target, "__name__", None) or str(target)


def is_lookup(op_name: str) -> bool:
    """aten embedding / embedding_bag ops, and fbgemm's table-batched embedding ops."""
    namespace, _, rest = op_name.partition(".")
    if namespace == "aten":
        return rest.split(".")[0] in LOOKUP_OPS
    return namespace == "fbgemm" and "embedding" in rest


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[_op_name(func)] += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn, inputs: tuple) -> Counter[str]:
    """ATen ops (after autograd, CompositeImplicit decomposed) one call of ``fn(*inputs)`` dispatches."""
    counter = _Counter()
    with torch.no_grad(), counter:
        fn(*inputs)
    return counter.ops


def graph_ops(graph_module: torch.fx.GraphModule) -> Counter[str]:
    """Op nodes of an FX graph by target (an exported program's ``graph_module``); Python plumbing such as
    ``operator.getitem`` on a multi-output op is not an op and is not counted."""
    return Counter(
        _op_name(n.target) for n in graph_module.graph.nodes
        if n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
    )


def count_lookups(ops: Counter[str]) -> int:
    return sum(n for name, n in ops.items() if is_lookup(name))
