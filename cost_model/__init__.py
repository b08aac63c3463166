"""Cost model: cluster specs, the device catalog, and pure estimators of time and memory."""

from cost_model.spec import Cluster, DeviceSpec, Dtype, Link, MemoryBreakdown

__all__ = ["Cluster", "DeviceSpec", "Dtype", "Link", "MemoryBreakdown"]
