"""Expert parallelism's terms: where experts live, the all-to-all, the busiest rank's share.

Layout (torchtitan's): ``ep`` ranks hold disjoint slices of every MoE block's experts
(``num_experts / ep`` each). The ep group is carved out of the data-parallel ranks, from the
FSDP shard axis first (``ep_fsdp = gcd(ep, fsdp)``) and the rest from the replicate axis
(``ep_dp = ep / ep_fsdp``): the ranks of one ep group are adjacent data-parallel ranks. Expert
weights are then FSDP-sharded over the ``fsdp / ep_fsdp`` ranks that hold the same experts and
replicated over ``dp / ep_dp``, so a rank holds ``1 / (ep_dp * fsdp)`` of the expert parameters
(``1 / fsdp`` of the dense ones): the memory EP saves is the share carved from dp; what it
saves in time is the experts' gradient/gather traffic of that share, paid for with tokens.

Tokens: every rank routes its own tokens; each token goes to ``top_k`` experts (to every
expert where the model runs each expert on every token, dense dispatch: ``ir.MoE.fanout``), so
a dispatch all-to-all moves ``tokens * fanout * hidden`` activations per rank, ``(ep - 1) / ep``
of them to other ranks, and the combine brings as many back; backward does both again (4 per MoE block and
step of one microbatch). Routing is assumed balanced on average (the IR's expert FLOPs are at
``tokens * top_k / num_experts`` rows per expert), and the busiest ep rank is assumed to get
``IMBALANCE`` times the mean rows (no token dropping): its expert compute and its all-to-all
volume are charged at that factor. Dense dispatch has no routing to unbalance: factor 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost_model.estimate import blocking_collective_s, collective_time_s
from autopar.cost_model.spec import Cluster, DeviceSpec, Link

# the busiest ep rank's rows over the mean (assumption: a trained router with an aux loss keeps
# the load within ~25% of even; GShard/Switch train with capacity factors 1.0-1.25)
IMBALANCE = 1.25
# all-to-alls per MoE block per microbatch: dispatch and combine, forward and backward
ALL_TO_ALLS = 4
# the emitted runtime's routing exchange before each dispatch (forward only, no autograd): each
# rank's row count per ep rank, then the expert id of every row it sends, both int64
ROUTING_BYTES = 8


def ep_split(ep: int, dp: int, fsdp: int) -> tuple[int, int]:
    """(ep_dp, ep_fsdp): how many of the ep ranks come from the replicate and the shard axis."""
    ep_fsdp = math.gcd(ep, fsdp)
    return ep // ep_fsdp, ep_fsdp


def ep_link(cluster: Cluster, ep: int, dp: int, fsdp: int, inner: int) -> Link:
    """The link the ep group's all-to-all crosses: its ranks span ``ep_fsdp * inner``
    consecutive ranks when carved from fsdp alone, else ``ep_dp * fsdp * inner`` (``inner``:
    the product of the axes inside fsdp, e.g. tp)."""
    ep_dp, ep_fsdp = ep_split(ep, dp, fsdp)
    span = ep_fsdp * inner if ep_dp == 1 else ep_dp * fsdp * inner
    if ep == 1 or (span <= cluster.devices_per_node and cluster.devices_per_node % span == 0):
        return cluster.intra_node
    return cluster.inter_node


def all_to_all_bytes(
    tokens: float, fanout: float, hidden: int, act_bytes: int, imbalance: float = IMBALANCE
) -> float:
    """Bytes one rank dispatches in one all-to-all (its tokens, each to ``fanout`` experts:
    top_k where the router picks, every expert under dense dispatch), at the busiest rank's
    load (``imbalance``: 1 where no routing decides the rows)."""
    return tokens * fanout * hidden * act_bytes * imbalance


def all_to_all_s(link: Link, ep: int, num_bytes: float, device: DeviceSpec | None = None) -> float:
    """One all-to-all of ``num_bytes`` per rank over ``ep`` ranks (pairwise exchange); with
    ``device``, as the blocking collective it is in a step
    (:func:`cost_model.estimate.blocking_collective_s`: the device's per-call cost added)."""
    if device is None:
        return collective_time_s("all_to_all", num_bytes, ep, link)
    return blocking_collective_s("all_to_all", num_bytes, ep, link, device)


def block_all_to_all_s(
    link: Link,
    ep: int,
    blocks: Sequence[tuple[float, float, int, float]],
    act_bytes: int,
    device: DeviceSpec | None = None,
) -> float:
    """The all-to-alls of one microbatch through MoE blocks given as (tokens, fanout, hidden,
    imbalance) (:func:`all_to_all_bytes`):
    dispatch and combine, forward and backward (:data:`ALL_TO_ALLS`), and the two routing
    exchanges that precede each dispatch (row counts, expert ids: :data:`ROUTING_BYTES` each;
    on CPU/gloo they took 4.3 ms of a 61 ms step of tests/models/moe.py at ep=2, two blocks,
    benchmarks/calibrate.py's "moe ep"). Every one of them blocks the layer that makes it:
    with ``device`` each pays its per-call cost in a step (:func:`all_to_all_s`)."""
    return sum(
        ALL_TO_ALLS * all_to_all_s(link, ep, all_to_all_bytes(t, k, h, act_bytes, imb), device)
        + all_to_all_s(link, ep, ROUTING_BYTES * ep, device)
        + all_to_all_s(link, ep, all_to_all_bytes(t, k, 1, ROUTING_BYTES, imb), device)
        for t, k, h, imb in blocks
    )


def imbalance(dense: bool) -> float:
    """The busiest ep rank's rows over the mean: 1 under dense dispatch, else :data:`IMBALANCE`."""
    return 1.0 if dense else IMBALANCE
