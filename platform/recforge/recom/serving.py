"""A RECom-compiled model served as an MLflow pyfunc (stored through recforge.tracking.recom_models).

The pyfunc's one artifact is the file ``recforge.recom.save`` writes (residual dense program, packed
tables, compiled column plan, metadata). ``predict`` takes a dict of arrays keyed by the model's flat
input names (``CompiledModel.input_names``; for the DLRM: dense, dense_valid, sparse, sparse_valid, and for each
multi-hot column ``<column>`` values int64[N] + ``<column>_lengths`` int64[B], also accepted as the captured
``jagged_<column>`` / ``jagged_<column>_lengths``) and returns a numpy array. ``model_config={"backend": "export"}``
at load time skips AOTInductor's recompilation (the default is the backend the model was compiled with).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from recforge.preprocess.module import LENGTHS_SUFFIX
from recforge.recom.compile import CompiledModel, load
from recforge.tracking.recom_models import register_compiled as _register

# what the predictor imports, pinned into the pyfunc's environment
SERVING_PACKAGES = ("torch", "torchrec", "fbgemm-gpu-cpu", "numpy", "symengine")


class CompiledPredictor:
    """A compiled model called with a dict of arrays keyed by its input names."""

    def __init__(self, model: CompiledModel) -> None:
        self.model = model

    def __call__(self, model_input: Any):
        model = self.model
        names = model.input_names
        if names is None or model.in_spec is None:
            raise ValueError("this compiled model does not record its input names; call it from Python instead")
        if not isinstance(model_input, dict):
            raise TypeError(f"model_input must be a dict of arrays keyed by {names}, got {type(model_input).__name__}")
        aliases = model.metadata.get("input_aliases") or names
        keys = [n if n in model_input or a not in model_input else a for n, a in zip(names, aliases, strict=True)]
        missing = [a for n, a in zip(keys, aliases, strict=True) if n not in model_input]
        if missing:
            raise KeyError(f"model_input lacks inputs {missing} (expected {aliases})")
        leaves = [torch.as_tensor(model_input[n]) for n in keys]
        _check_lists(dict(zip(aliases, leaves, strict=True)))
        args = pytree.tree_unflatten(leaves, model.in_spec)
        return model(*args).detach().cpu().numpy()


def _check_lists(inputs: dict[str, torch.Tensor]) -> None:
    """A list column's lengths must add up to its values (the compiled graph does not check it)."""
    for key, lengths in inputs.items():
        values = inputs.get(key[:-len(LENGTHS_SUFFIX)]) if key.endswith(LENGTHS_SUFFIX) else None
        if values is None:
            continue
        if values.dim() != 1 or lengths.dim() != 1:
            raise ValueError(f"list column {key[:-len(LENGTHS_SUFFIX)]!r}: values and lengths must be 1-D, got "
                             f"shapes {list(values.shape)} and {list(lengths.shape)}")
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.shape[0] or bool((lengths < 0).any()):
            raise ValueError(f"list column {key[:-len(LENGTHS_SUFFIX)]!r}: lengths (sum {total}) do not match "
                             f"{values.shape[0]} values, or are negative")


def load_predictor(path: str, model_config: Mapping[str, Any]) -> CompiledPredictor:
    """The pyfunc's loader: the compiled file at `path`, on `model_config["backend"]` if given."""
    return CompiledPredictor(load(path, backend=model_config.get("backend")))


def register_compiled(store, run_id: str, compiled_path: str | Path, trained_name: str, *, max_abs_diff: float,
                      atol: float, tags: dict[str, str] | None = None) -> str:
    """Log the compiled file as a pyfunc and register it as ``<trained_name>-compiled`` (only when it
    matched eager: ``max_abs_diff <= atol``, ValueError otherwise); idempotent per run."""
    return _register(store, run_id, compiled_path, trained_name, loader=load_predictor,
                     requirements=SERVING_PACKAGES, max_abs_diff=max_abs_diff, atol=atol,
                     description=f"RECom-compiled inference of {trained_name}", tags=tags)
