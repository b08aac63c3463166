"""IR: trace an unmodified nn.Module on meta tensors and lower it to autopar's graph IR."""

from autopar.ir._saved import SavedBytes, measure_saved
from autopar.ir.graph import (
    Graph,
    Layer,
    ModuleInfo,
    MoE,
    Node,
    PositionTable,
    Ref,
    TensorMeta,
    dtype_bytes,
)
from autopar.ir.trace import TraceError, trace

__all__ = [
    "Graph",
    "Layer",
    "ModuleInfo",
    "MoE",
    "Node",
    "PositionTable",
    "Ref",
    "SavedBytes",
    "TensorMeta",
    "TraceError",
    "dtype_bytes",
    "measure_saved",
    "trace",
]
