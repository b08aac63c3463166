"""launch.sh's side of a launch on several nodes: which nodes reached the rendezvous when it
times out (``report_rendezvous``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

__all__ = ["report_rendezvous"]

# launch.sh on several nodes bounds the rendezvous: past RDZV_TIMEOUT_S with no rank started on
# its node, it runs report_rendezvous, which reads torch's c10d rendezvous state from the store
# at RDZV_ENDPOINT (as a client, bounded; torch keeps the state under "torch.rendezvous.<id>",
# base64 of a pickle, read here with an unpickler that builds only the state's own classes) and
# says which nodes arrived; launch.sh then ends its torchrun (no rank has started) and exits 2.
_RENDEZVOUS_CLASSES = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
}


def _rendezvous_state(host: str, port: int, run_id: str, wait_s: float = 10.0):
    """(torch's rendezvous state, "") or (None, why there is none): a TCP connection first
    (nothing listening is quick to tell), then a store client in a thread, since a server that
    is not a torch store (another program on the port) leaves the client waiting past its
    timeout."""
    import base64
    import io
    import pickle
    import threading

    try:
        socket.create_connection((host, port), timeout=wait_s).close()
    except OSError as e:
        return None, f"nothing answers at {host}:{port} ({e.strerror or e})"
    found: dict = {}

    def read() -> None:
        with contextlib.suppress(Exception):  # no store there: found stays empty
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s))
            key = f"torch.rendezvous.{run_id}"
            found["bits"] = store.get(key) if store.check([key]) else b""

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(wait_s + 1)
    if "bits" not in found:
        return (
            None,
            f"{host}:{port} answers, but not as a torch rendezvous: another program holds it",
        )
    bits = base64.b64decode(found["bits"]) if found["bits"] else b""
    if bits in (b"", b"canimadam"):  # torch's sentinel for a rendezvous no node has joined
        return None, f"the store at {host}:{port} holds no rendezvous {run_id!r}"

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) not in _RENDEZVOUS_CLASSES:
                raise pickle.UnpicklingError(f"{module}.{name} is not in a rendezvous state")
            return super().find_class(module, name)

    try:
        return Unpickler(io.BytesIO(bits)).load(), ""
    except Exception as e:  # another torch's state, or not torch's: say so, nothing more
        return None, f"the rendezvous state at {host}:{port} is unreadable ({e})"


def _node_name(addr: str) -> str:
    """A node as SLURM names it: a hostname's first label; an IP address whole."""
    return addr if addr.replace(".", "").isdigit() or ":" in addr else addr.split(".")[0]


def report_rendezvous(nodes: int, timeout_s: int) -> None:
    """launch.sh's rendezvous wait ran out on this node (see above): exit 0 if the rendezvous
    completed after all (the ranks are starting), else say which nodes arrived and which did
    not (by name where AUTOPAR_NODES lists the job's nodes, as launch.slurm sets it), record
    the line for launch.sh (AUTOPAR_ERROR_FILE) and exit 2."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    endpoint, run_id = os.environ["RDZV_ENDPOINT"], os.environ["RDZV_ID"]
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    state, why = _rendezvous_state(host, port, run_id)
    if state is not None and state.complete:
        sys.exit(0)
    waited = f"within {timeout_s} s (RDZV_TIMEOUT_S)"
    same = "with the same RDZV_ENDPOINT and RDZV_ID"
    if state is None:
        me = os.environ.get("LOCAL_ADDR") or socket.getfqdn()
        fix = (
            "choose a free port (RDZV_ENDPOINT or MASTER_PORT)"
            if "another program" in why
            else f"start launch.sh on the first node, which hosts it (with RDZV_IS_HOST=1 if "
            f"its hostname is not {host}), {same}"
        )
        message = (
            f"the rendezvous at {endpoint} (RDZV_ID {run_id}) did not start {waited}: {why}; "
            f"1 of {nodes} nodes ({me}) waited: {fix}"
        )
    else:
        arrived = sorted({n.addr for n in [*state.participants, *state.wait_list]})
        expected = os.environ.get("AUTOPAR_NODES", "").split()
        missing = sorted(set(expected) - {_node_name(a) for a in arrived})
        absent = f"{nodes - len(arrived)} did not" + (f" ({', '.join(missing)})" if missing else "")
        message = (
            f"the rendezvous at {endpoint} (RDZV_ID {run_id}) did not complete {waited}: "
            f"{len(arrived)} of {nodes} nodes arrived ({', '.join(arrived) or 'none'}), "
            f"{absent}: start launch.sh on every node {same} (or wait longer: RDZV_TIMEOUT_S)"
        )
    print(f"error: {message}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError, KeyError), open(os.environ["AUTOPAR_ERROR_FILE"], "a") as f:
        f.write(f"{message}\n")
    sys.exit(2)
