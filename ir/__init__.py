"""IR: trace an unmodified nn.Module on meta tensors and lower it to autopar's graph IR."""

from autopar.ir._saved import SavedBytes, measure_saved
from autopar.ir.graph import Graph, Layer, ModuleInfo, Node, Ref, TensorMeta, dtype_bytes
from autopar.ir.model_file import (
    ModelFile,
    ModelFileError,
    build_on_meta,
    example_inputs,
    load_model_file,
)
from autopar.ir.trace import TraceError, trace

__all__ = [
    "Graph",
    "Layer",
    "ModelFile",
    "ModelFileError",
    "ModuleInfo",
    "Node",
    "Ref",
    "SavedBytes",
    "TensorMeta",
    "TraceError",
    "build_on_meta",
    "dtype_bytes",
    "example_inputs",
    "load_model_file",
    "measure_saved",
    "trace",
]
