"""Cost model: cluster specs, the device catalog, and pure estimators of time and memory."""

from cost_model.spec import Cluster, DeviceSpec, Dtype, Link

__all__ = ["Cluster", "DeviceSpec", "Dtype", "Link"]
