"""``parse_cluster``: what users type after ``--cluster``, turned into a validated ``Cluster``.

Accepted: ``cpu:N`` (N local gloo processes), ``H100`` (one GPU), ``8xH100`` (one node of 8),
``4x8xA100-80GB`` (nodes x GPUs per node), groups of nodes of different kinds joined by ``+``
(``2x8xH100+2x8xA100-80GB``: ranks numbered group after group), or a ``.json`` / ``.toml`` file
with the keys of ``_ClusterFile`` (or ``groups``, a list of them, and ``inter_group``). Every
invalid input raises ``ClusterSpecError`` with one line.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from autopar.cost_model.catalog import (
    canonical_name,
    cpu_device,
    device,
    gpu_links,
    usable_cpu_count,
)
from autopar.cost_model.spec import (
    MAX_WORLD_SIZE,
    Cluster,
    ClusterSpecError,
    DeviceSpec,
    Link,
    NodeGroup,
)
from autopar.cost_model.versioned import DuplicateKeyError, unique_keys
from pydantic import BaseModel, ConfigDict, Field, ValidationError

_FORMS = (
    "cpu:N, DEVICE, GPUSxDEVICE, NODESxGPUSxDEVICE (e.g. 8xH100, 4x8xA100-80GB), groups joined "
    "by + (2x8xH100+2x8xA100-80GB) or a .json/.toml file"
)

# Measured in ARCHITECTURE.md: gloo all_reduce on 2 local processes, fp32, per-rank bytes
# (KB and MB read as 2^10 and 2^20): 0.39 ms at 1 KB, 7.8 ms at 16 MB.
_GLOO_ALL_REDUCE_2P: tuple[tuple[float, float], tuple[float, float]] = (
    (2.0**10, 0.39e-3),
    (16 * 2.0**20, 7.8e-3),
)


_Count = Annotated[int, Field(strict=True, gt=0)]
"""a device or node count: a JSON/TOML integer >= 1 (not true, 8.0 or "8")."""


class _ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str | dict[str, Any]
    """a catalog name, or a full DeviceSpec."""
    num_nodes: _Count = 1
    devices_per_node: _Count
    intra_node: Link | None = None
    """default: the catalog's link for the device."""
    inter_node: Link | None = None
    backend: Literal["gloo", "nccl"] | None = None
    """default: gloo for cpu, nccl for gpu."""


class _GroupedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[_ClusterFile] = Field(min_length=2)
    """each group's nodes: device, num_nodes, devices_per_node (the same in every group), links."""
    inter_group: Link | None = None
    """between nodes of different groups; default: the slowest group's inter_node link."""


def parse_cluster(spec: str) -> Cluster:
    """The Cluster that ``spec`` describes (see the module docstring for the forms)."""
    text = spec.strip()
    if text.lower().endswith((".json", ".toml")):
        return _from_file(spec)
    if "+" in text:
        parts = [part.strip() for part in text.split("+")]
        if any(not part or part.lower().startswith("cpu") for part in parts):
            raise ClusterSpecError(
                f"cluster spec {spec!r}: groups joined by + are GPU node groups, e.g. "
                "2x8xH100+2x8xA100-80GB (CPU groups of declared speeds: a .json/.toml file "
                "with 'groups')"
            )
        return grouped(spec, [_gpu_cluster(spec, part) for part in parts])
    if match := re.fullmatch(r"cpu(?::(.*))?", text, flags=re.IGNORECASE):
        count = "1" if match.group(1) is None else match.group(1)
        return _cpu_cluster(spec, _count(spec, count, "cpu:N needs an integer N >= 1, e.g. cpu:2"))
    if "/" in text or "\\" in text or re.search(r"\.[A-Za-z]+$", text):
        raise ClusterSpecError(f"cluster file {spec!r}: cluster files must end in .json or .toml")
    return _gpu_cluster(spec, text)


def _gpu_cluster(spec: str, text: str) -> Cluster:
    match = re.fullmatch(
        r"(?:([-+]?[\d.]+)x)?(?:([-+]?[\d.]+)x)?([A-Za-z].*)", text, flags=re.IGNORECASE
    )
    if not match:
        raise ClusterSpecError(f"cluster spec {spec!r} is not one of: {_FORMS}")
    first, second, name = match.groups()
    rule = "node and GPU counts must be integers >= 1, e.g. 8xH100 or 2x8xH100"
    nodes = _count(spec, first, rule) if second is not None else 1
    per_node = _count(spec, second if second is not None else first or "1", rule)
    if canonical_name(name) == "cpu":
        raise ClusterSpecError(f"cluster spec {spec!r}: CPU clusters are written cpu:N, e.g. cpu:2")
    intra, inter = gpu_links(name)
    return _build(
        spec,
        dict(
            device=device(name),
            num_nodes=nodes,
            devices_per_node=per_node,
            intra_node=intra,
            inter_node=inter,
            backend="nccl",
        ),
    )


def _count(spec: str, value: str, rule: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", value) or int(value) < 1:
        raise ClusterSpecError(f"cluster spec {spec!r}: {value!r} is not valid: {rule}")
    return int(value)


def gloo_link(num_processes: int) -> Link:
    """Loopback gloo between ``num_processes`` local processes, from the 2-process measurements.

    On n = 2 ranks all_reduce costs t = 2(n-1) alpha + 2(n-1)/n B / busbw = 2 alpha + B / busbw,
    so two (B, t) points give busbw = dB / dt (~2.26 GB/s) and alpha = (t1 - B1 / busbw) / 2
    (~0.195 ms a ring step). Oversubscribed (r = processes / cores > 1) processes share cores:
    bandwidth / r and latency * r^2 (4 processes on 2 cores then predict 4.7 ms for a small
    all_reduce; ARCHITECTURE.md measured 5-7 ms).
    """
    (b1, t1), (b2, t2) = _GLOO_ALL_REDUCE_2P
    bus_bandwidth = (b2 - b1) / (t2 - t1)
    alpha = (t1 - b1 / bus_bandwidth) / 2
    ratio = max(1.0, num_processes / usable_cpu_count())
    return Link(
        name="gloo-loopback",
        bandwidth_bytes_per_s=bus_bandwidth / ratio,
        latency_s=alpha * ratio**2,
        source="ARCHITECTURE.md gloo all_reduce on 2 processes: 0.39 ms at 1 KB, 7.8 ms at 16 MB; "
        f"oversubscription ratio {ratio:.3g} (bandwidth / r, latency * r^2)",
    )


def _cpu_cluster(spec: str, num_processes: int) -> Cluster:
    link = gloo_link(num_processes)
    return _build(
        spec,
        dict(
            device=cpu_device(num_processes),
            num_nodes=1,
            devices_per_node=num_processes,
            intra_node=link,
            inter_node=link,
            backend="gloo",
        ),
    )


def _build(spec: str, fields: dict[str, Any]) -> Cluster:
    world = fields["num_nodes"] * fields["devices_per_node"]
    if world > MAX_WORLD_SIZE:
        raise ClusterSpecError(
            f"cluster {spec!r} has {world} devices, more than the {MAX_WORLD_SIZE} autopar plans "
            "for: check the node and device counts"
        )
    try:
        return Cluster(spec=spec, **fields)
    except ValidationError as err:
        raise ClusterSpecError(_one_line(spec, err)) from None


def _one_line(where: str, err: ValidationError, prefix: str = "") -> str:
    first = err.errors()[0]
    loc = prefix + ".".join(str(part) for part in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a whole-model check: the input is the whole spec, too long to echo
        loc, fix = "cluster", "change the spec"
    elif first["type"] == "extra_forbidden":
        fix = f"allowed keys: {', '.join(_ClusterFile.model_fields)}"
    elif first["type"] == "missing":
        fix = "add it"
    else:
        got = repr(first.get("input"))
        got = got if len(got) <= 60 else f"{got[:40]}... ({len(got)} characters)"
        fix = f"got {got}; fix that value"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{where}: {loc}: {msg}; {fix}{more}".replace("\n", " ")


def _read_file(spec: str) -> dict[str, Any]:
    path = Path(spec.strip()).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ClusterSpecError(
            f"cluster file {spec!r} {what}; give an existing .json/.toml file or one of: {_FORMS}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ClusterSpecError(
            f"{spec}: not UTF-8 text (byte {err.start}): give a .json/.toml cluster file"
        ) from None
    except OSError as err:
        raise ClusterSpecError(
            f"cluster file {spec!r} cannot be read ({err.strerror}): check its permissions"
        ) from None
    import tomllib  # Python >= 3.11; imported here so that the rest works on 3.10

    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=unique_keys)
        else:
            data = tomllib.loads(text)
    except RecursionError:
        raise ClusterSpecError(f"{spec}: nested too deeply to be a cluster file; fix it") from None
    except DuplicateKeyError as err:
        raise ClusterSpecError(
            f"{spec}: key {err.key!r} appears twice in one object: keep one of them"
        ) from None
    except json.JSONDecodeError as err:
        raise ClusterSpecError(
            f"{spec}: malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}; fix the file"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ClusterSpecError(f"{spec}: malformed TOML: {err}; fix the file") from None
    if not isinstance(data, dict):
        raise ClusterSpecError(
            f"{spec}: the top level must be an object of cluster keys, got {type(data).__name__}"
        )
    return data


def _check_finite(spec: str, value: Any, where: str = "") -> None:
    """JSON (``Infinity``, ``NaN``) and TOML (``inf``, ``nan``) can spell non-finite numbers;
    no cluster figure is infinite, and a plan could not save one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ClusterSpecError(
            f"{spec}: {where}: {value} is not a finite number; give a real value"
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(spec, v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(spec, v, f"{where}.{i}")


def _speed(dev: DeviceSpec) -> float:
    """Large-matmul FLOP/s: what orders groups from slowest to fastest."""
    flops = dev.peak_flops.get("bf16") or dev.peak_flops.get("fp32") or 0.0
    return flops * dev.matmul_efficiency / dev.compute_scale


def grouped(spec: str, parts: list[Cluster], inter_group: Link | None = None) -> Cluster:
    """One cluster of the node groups ``parts`` (each a cluster of one kind), ranks numbered
    group after group. The cluster's own ``device`` is the uniform treatment (the slowest
    group's device, the smallest memory), its links the slowest of the groups'. GPU groups
    need the same GPUs per node (the device mesh lays ranks out evenly); CPU groups are groups
    of processes on this host: the cluster is one node of them all, its links gloo's."""
    cpu = parts[0].device.kind == "cpu"
    if any((p.device.kind == "cpu") != cpu for p in parts):
        raise ClusterSpecError(
            f"cluster {spec!r}: every group is of one kind: all GPU nodes or all CPU processes"
        )
    per_node = {p.devices_per_node for p in parts}
    if len(per_node) > 1 and not cpu:
        counts = " and ".join(str(p.devices_per_node) for p in parts)
        raise ClusterSpecError(
            f"cluster {spec!r}: every group needs the same devices per node ({counts} here): "
            "the device mesh lays ranks out evenly; give each group's nodes the same count"
        )
    if cpu and any(p.num_nodes > 1 for p in parts):
        raise ClusterSpecError(
            f"cluster {spec!r}: CPU groups are groups of processes on this host: give each "
            "num_nodes = 1 and its processes as devices_per_node"
        )
    slowest = min(parts, key=lambda p: _speed(p.device))
    memory = min(p.device.memory_bytes for p in parts)
    uniform = slowest.device.model_copy(
        update={
            "memory_bytes": memory,
            "source": f"uniform treatment of {spec}: the slowest group's device "
            f"({slowest.device.name}), the smallest memory; {slowest.device.source}",
        }
    )
    slow_link = lambda links: min(links, key=lambda k: k.bandwidth_bytes_per_s)  # noqa: E731
    world = sum(p.world_size for p in parts)
    if cpu:  # processes on this host share its cores
        link = inter_group or gloo_link(world)
        parts = [p.model_copy(update={"intra_node": link, "inter_node": link}) for p in parts]
    groups = tuple(
        NodeGroup(device=p.device, num_nodes=p.num_nodes, devices=p.world_size,
                  intra_node=p.intra_node, inter_node=p.inter_node)
        for p in parts
    )  # fmt: skip
    inter = inter_group or slow_link([p.inter_node for p in parts])
    return _build(
        spec,
        dict(
            device=uniform,
            num_nodes=1 if cpu else sum(p.num_nodes for p in parts),
            devices_per_node=world if cpu else parts[0].devices_per_node,
            intra_node=slow_link([p.intra_node for p in parts]),
            inter_node=slow_link([inter, *(p.inter_node for p in parts)]),
            backend=parts[0].backend,
            groups=groups,
        ),
    )


def _from_file(spec: str) -> Cluster:
    data = _read_file(spec)
    _check_finite(spec, data)
    if "groups" in data:
        try:
            raw_groups = _GroupedFile.model_validate(data)
        except ValidationError as err:
            raise ClusterSpecError(_one_line(spec, err)) from None
        parts = [_from_raw(spec, raw) for raw in raw_groups.groups]
        return grouped(spec, parts, raw_groups.inter_group)
    try:
        raw = _ClusterFile.model_validate(data)
    except ValidationError as err:
        raise ClusterSpecError(_one_line(spec, err)) from None
    return _from_raw(spec, raw)


def _from_raw(spec: str, raw: _ClusterFile) -> Cluster:
    dev = _file_device(spec, raw)
    if raw.backend is not None and raw.backend != ("gloo" if dev.kind == "cpu" else "nccl"):
        want = "gloo" if dev.kind == "cpu" else "nccl"
        raise ClusterSpecError(
            f"{spec}: backend: {raw.backend!r} does not run on {dev.kind} device {dev.name!r}, "
            f"whose collectives need {want}: set backend = {want!r} or leave it out"
        )
    intra, inter = _default_links(spec, dev, raw)
    return _build(
        spec,
        dict(
            device=dev,
            num_nodes=raw.num_nodes,
            devices_per_node=raw.devices_per_node,
            intra_node=raw.intra_node or intra,
            inter_node=raw.inter_node or inter,
            backend=raw.backend or ("gloo" if dev.kind == "cpu" else "nccl"),
        ),
    )


def _file_device(spec: str, raw: _ClusterFile) -> DeviceSpec:
    if isinstance(raw.device, str):
        try:
            return device(raw.device, processes_per_node=raw.devices_per_node)
        except ClusterSpecError as err:
            raise ClusterSpecError(f"{spec}: device: {err}") from None
    try:
        dev = DeviceSpec.model_validate(raw.device)
    except ValidationError as err:
        raise ClusterSpecError(_one_line(spec, err, prefix="device.")) from None
    if dev.kind == "cpu" and dev.host_cpus is None:  # a machine fact, read once, kept as data
        dev = dev.model_copy(update={"host_cpus": os.cpu_count() or 1})
    return dev


def _default_links(
    spec: str, dev: DeviceSpec, raw: _ClusterFile
) -> tuple[Link | None, Link | None]:
    """The catalog's links for the device, where it has them and the file leaves them out."""
    if raw.intra_node and raw.inter_node:
        return None, None
    if dev.kind == "cpu" and raw.num_nodes == 1:
        link = gloo_link(raw.devices_per_node)
        return link, link
    try:
        if dev.kind == "gpu":
            return gpu_links(dev.name)
    except ClusterSpecError:
        pass
    raise ClusterSpecError(
        f"{spec}: no default links for device {dev.name!r} on {raw.num_nodes} node(s); "
        "add intra_node and inter_node, e.g. {name, bandwidth_bytes_per_s, latency_s}"
    )
