"""IR: trace an unmodified nn.Module on meta tensors and lower it to autopar's graph IR."""

from ir._saved import SavedBytes, measure_saved
from ir.graph import Graph, Layer, ModuleInfo, Node, Ref, TensorMeta, dtype_bytes
from ir.model_file import (
    ModelFile,
    ModelFileError,
    build_on_meta,
    example_inputs,
    load_model_file,
)
from ir.trace import TraceError, trace

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
