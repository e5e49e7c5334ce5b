"""RECom: compiled inference of DLRM-style models (first form: gather lowering + torch.export)."""
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
from recforge.recom.errors import CompileMismatchError, NotOneHotError, RecomError, UnsupportedModelError
from recforge.recom.inference import GatherInferenceModule, InferenceModule

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "CompiledModel", "CompileMismatchError", "GatherInferenceModule",
    "InferenceModule", "NotOneHotError", "RecomError", "UnsupportedModelError", "check_against_eager",
    "compile", "export_program", "load", "save",
]
