"""RECom: compiled inference of recommendation models with massive embedding columns.

``compile(module, example_inputs)`` captures the model with torch.export, finds its embedding columns
(RECom Alg. 1), proves shape facts with SymEngine, simplifies each column (range analysis, filter
merging, empty rows, one-hot gathers) and runs all of them as one fused op, the dense net through
export / Inductor / AOTInductor. See compile.py for the pipeline and each module for its step.
"""
from recforge.recom.compile import (
    BACKENDS,
    DEFAULT_BACKEND,
    CompiledModel,
    check_against_eager,
    compile,
    export_program,
    load,
    save,
)
from recforge.recom.errors import (
    CompileMismatchError,
    LookupIndexError,
    NotOneHotError,
    RecomError,
    UnsupportedModelError,
)
from recforge.recom.inference import GatherInferenceModule, InferenceModule

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "CompiledModel", "CompileMismatchError", "GatherInferenceModule",
    "InferenceModule", "LookupIndexError", "NotOneHotError", "RecomError", "UnsupportedModelError",
    "check_against_eager", "compile", "export_program", "load", "save",
]
