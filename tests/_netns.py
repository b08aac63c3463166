"""Two hosts for multi-node tests: network namespaces joined by a veth pair (root and iproute2;
the test is skipped where they cannot be made)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest
from _plans import BIN, harness_env


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def two_hosts(
    prefix: str, subnet: str, before_delete: Callable[[str], None] | None = None
) -> Iterator[list[tuple[str, str, str]]]:
    """Yield [(namespace, interface, address)] for two hosts named ``prefix``N on ``subnet``.x,
    deleted afterwards (``before_delete(namespace)`` first, e.g. to kill what runs there)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("making network namespaces needs root and iproute2 (`ip`)")
    tag = f"{os.getpid() % 100000}"
    made, hosts = [], []
    try:
        for i in range(2):
            ns = f"{prefix}n{i}-{tag}"
            ip("netns", "add", ns)
            made.append(ns)
            hosts.append((ns, f"{prefix}v{i}-{tag}", f"{subnet}.{i + 1}"))
        ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        stderr = getattr(e, "stderr", b"") or b""
        pytest.skip(f"cannot make network namespaces here: {stderr.decode().strip() or e}")
    yield hosts
    for ns, _, _ in hosts:
        if before_delete is not None:
            before_delete(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def host_env(
    host: tuple[str, str, str], index: int, subnet: str, rdzv_id: str, extra: dict[str, str]
) -> dict[str, str]:
    """The environment of a launcher on ``host`` (``two_hosts``' namespace, device, address),
    the ``index``-th host, host 0 the rendezvous host at ``subnet``.1; ``extra`` last (a fault
    to inject: the harness first on PYTHONPATH, ``_plans.harness_env``)."""
    _, dev, addr = host
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "DIST_TIMEOUT_S": "60",
        "RDZV_ENDPOINT": f"{subnet}.1:29400",
        "RDZV_ID": rdzv_id,
        "LOCAL_ADDR": addr,
        "RDZV_IS_HOST": "1" if index == 0 else "0",
        "GLOO_SOCKET_IFNAME": dev,
    }
    return harness_env({**env, **extra})
