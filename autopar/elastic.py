"""``plan --elastic MIN:MAX``: a plan for every node count a run may find itself on.

Each node count K in MIN..MAX is planned on the ``--cluster``'s nodes (the same device and
devices per node, K of them) with the same model, global batch, sequence length, dtype,
optimizer, pins, schedule, microbatches and checkpointing: the search fills in the rest for K,
accumulation included where the smaller world needs it to fit. The plans go out together
(:func:`autopar.codegen.write.write_outputs` with ``elastic=``): ``train.py`` and ``plan.json``
are the plan for MAX nodes, and ``plans/<K>nodes.py`` / ``plans/<K>nodes.json`` the one for
each K; the launchers start torchrun's elastic agent (``--nnodes MIN:MAX``) and each worker runs
the program of the node count it finds (``autopar_runtime.take_elastic_plan``).
"""

from __future__ import annotations

import re

from autopar._plan import Plan
from autopar.cost_model import Cluster
from autopar.errors import UserError

__all__ = ["ElasticError", "parse_elastic", "plan_node_counts"]

MAX_NODE_COUNTS = 64
"""The most node counts one ``--elastic`` range plans (each one is a search)."""


class ElasticError(UserError):
    """An ``--elastic`` range that cannot be planned."""


def parse_elastic(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (node counts, 1 <= MIN <= MAX) -> (MIN, MAX)."""
    match = re.fullmatch(r"\s*(\d{1,6})\s*:\s*(\d{1,6})\s*", text)
    if match is None:
        raise ElasticError(
            f"--elastic {text!r} is not MIN:MAX: give the node counts the run may have, e.g. "
            "--elastic 1:4"
        )
    low, high = int(match.group(1)), int(match.group(2))
    if not 1 <= low <= high:
        raise ElasticError(
            f"--elastic {text!r}: the counts must satisfy 1 <= MIN <= MAX: e.g. --elastic "
            f"{max(1, min(low, high))}:{max(1, low, high)}"
        )
    if high - low + 1 > MAX_NODE_COUNTS:
        raise ElasticError(
            f"--elastic {text!r} spans {high - low + 1} node counts, more than the "
            f"{MAX_NODE_COUNTS} autopar plans at once: narrow the range"
        )
    return low, high


def plan_node_counts(plan_one, cluster: Cluster, low: int, high: int) -> dict[int, Plan]:
    """``plan_one(cluster)`` (one search with the user's settings) for ``cluster`` on each node
    count in ``low..high``: node count -> plan. A count with no plan is one error naming it."""
    if cluster.heterogeneous:
        raise ElasticError(
            f"--elastic {low}:{high} on {cluster.spec}: elastic plans are for a cluster of one kind "
            "of node (which group loses a node would decide the plan); plan each node count of "
            "the mixed cluster with its own --cluster instead"
        )
    plans = {}
    for nodes in range(high, low - 1, -1):
        try:
            on_k = cluster.model_copy(update={"num_nodes": nodes})
            on_k = Cluster.model_validate(on_k.model_dump())  # its rules (world size), again
        except ValueError as e:
            raise ElasticError(f"--elastic {low}:{high} at {nodes} nodes: {e}") from None
        try:
            plans[nodes] = plan_one(on_k)
        except UserError as e:
            raise ElasticError(
                f"--elastic {low}:{high}: no plan for {nodes} node(s) of "
                f"{cluster.devices_per_node} ({e}); narrow the range or change the settings"
            ) from None
    return plans
