"""Step-by-step turns between two programs that benchmarks/overhead.py runs at once.

benchmarks/overhead.py ``--interleave`` (its default) starts the emitted program and the
hand-written one together and lets them take turns a step at a time: emitted step 1, hand-written
step 1, emitted step 2, ... (hand-written first in odd rounds), so each pair of steps runs within
a fraction of a second on the same machine, in the same load. Each rank of each program calls
``wait(step)`` after it logs a step; the call returns when the program may run its next step
(the benchmark's coordinator answers on a Unix socket: no polling, no CPU while waiting).
Without AUTOPAR_OVERHEAD_TURNS (``socket path:program name``) it returns at once.
"""

from __future__ import annotations

import os
import socket

__all__ = ["wait"]

_conn: list = []  # the connection to the coordinator, opened at the first wait


def wait(step: int) -> None:
    """Tell the coordinator this rank has finished ``step``; return when the next may start."""
    spec = os.environ.get("AUTOPAR_OVERHEAD_TURNS")
    if not spec:
        return
    if not _conn:
        path, name = spec.rsplit(":", 1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        _conn.append((sock.makefile("rw"), name))
    f, name = _conn[0]
    f.write(f"{name} {step}\n")
    f.flush()
    if f.readline().strip() != "go":
        raise SystemExit("error: the overhead benchmark's coordinator went away")
