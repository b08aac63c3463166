"""IR: trace an unmodified nn.Module on meta tensors and lower it to autopar's graph IR."""

from ir.graph import Graph, Layer, ModuleInfo, Node, Ref, TensorMeta, dtype_bytes

__all__ = ["Graph", "Layer", "ModuleInfo", "Node", "Ref", "TensorMeta", "dtype_bytes"]
