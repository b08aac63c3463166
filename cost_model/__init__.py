"""Cost model: cluster specs, the device catalog, and pure estimators of time and memory."""

from autopar.cost_model.catalog import DEVICE_NAMES, device
from autopar.cost_model.cluster import parse_cluster
from autopar.cost_model.estimate import (
    CollectiveKind,
    adamw_step_time_s,
    axis_link,
    collective_time_s,
    compute_time_s,
    memory_per_rank,
)
from autopar.cost_model.profile import (
    Profile,
    ProfileError,
    apply_profile,
    datasheet_profile,
    load_profile,
)
from autopar.cost_model.spec import (
    Cluster,
    ClusterSpecError,
    CollectiveCost,
    DeviceSpec,
    Dtype,
    Link,
    MemoryBreakdown,
)

__all__ = [
    "DEVICE_NAMES",
    "Cluster",
    "ClusterSpecError",
    "CollectiveCost",
    "CollectiveKind",
    "DeviceSpec",
    "Dtype",
    "Link",
    "MemoryBreakdown",
    "Profile",
    "ProfileError",
    "apply_profile",
    "adamw_step_time_s",
    "axis_link",
    "collective_time_s",
    "compute_time_s",
    "datasheet_profile",
    "device",
    "load_profile",
    "memory_per_rank",
    "parse_cluster",
]
