"""What the scoring of meshes shares: a search's :class:`_Space` (the graph, cluster, training,
options and mesh facts; the per-layer tables every mesh reads; the intra-layer ILP per tp
degree) and one mesh's :class:`_Ctx` (its axes, links, precision regime and the ILP's answer
per local batch). :mod:`planner.score` scores a mesh with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost_model import Cluster, axis_link
from autopar.cost_model.precision import Precision, precision
from autopar.ir import Graph
from autopar.planner import ilp, stages
from autopar.planner.groups import group_time_scales
from autopar.planner.plan import Mesh, Training
from autopar.planner.request import SDPA_OP, Options, mesh_facts, root_unit_layers
from autopar.planner.rules import MeshFacts


@dataclass(frozen=True)
class _Space:
    """What every mesh of one search shares."""

    graph: Graph
    cluster: Cluster
    training: Training
    options: Options
    facts: MeshFacts
    """what the mesh rules read (:func:`planner.request.mesh_facts`)."""
    out_bytes: dict[str, int]
    """layer -> bytes later layers read from it (traced batch)."""
    tensors: dict[str, int]
    """layer -> number of trainable parameter tensors (the optimizer's)."""
    root_layers: frozenset[int]
    """indices of the layers whose parameters the root FSDP unit holds (``_root_layers``)."""
    fsdp_root: tuple[str, ...]
    """:func:`planner.request.root_unit_layers` of the graph (the plan's ``fsdp_root``)."""
    param_tensors: int
    """parameter tensors of the whole model (every module's direct parameters)."""
    collapsed: ilp.Collapsed
    shard_tp: bool = False
    """tp was pinned: the ILP shards every module that can be sharded at that degree."""
    optima: dict[int, dict] | None = None
    """tp -> the ILP's proven optima (``ilp.Solver``'s ``optima``) shared with the caller, who
    keeps them across searches of this graph (a planning session); None: this search's own."""
    kv_bytes: dict[str, int] = field(default_factory=dict)
    """layer -> bytes of the keys and values its attention calls read (traced batch): what
    context parallelism exchanges."""
    cuts: stages.Cuts | None = None
    """where the layers can be cut into pipeline stages (None: at every layer)."""
    held_inputs: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    """layer -> what a checkpoint of it holds (:func:`_held_inputs`)."""
    solvers: dict[int, ilp.Solver] = field(default_factory=dict)
    """the intra-layer ILP per tp degree, built on first use: this search's, and only its."""
    unit_numels: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """per ep degree, the distinct (parameters, trainable) of the FSDP units but the root as
    one rank gathers them (:func:`planner.experts._gathered`), in layer order; filled by
    :mod:`planner.score` on first use."""
    layer_keys: tuple[int, ...] = ()
    """per layer, a number for what its cost table reads of the graph (:func:`_layer_keys`):
    layers with equal keys and equal ILP answers (a run of identical blocks) cost the same,
    computed once."""
    layer_groups: tuple[int, ...] = ()
    """per layer, its group: layers of one group have equal :attr:`layer_keys`, one
    representative in the ILP's collapsed graph (so one ILP answer: its parts, sharded bytes,
    activations and held layouts) and the same place (the last layer carries the loss): their
    cost tables are equal in every solution, and :mod:`planner.score` writes one per group."""
    trainable_tensors: tuple[tuple[tuple[str, int, bool], ...], ...] = ()
    """per layer, its trainable parameter tensors as (module FQN, numel, an expert's): what the
    optimizer's temporaries are sized by (:mod:`planner.score`)."""
    group_scales: tuple[float, ...] = ()
    """a cluster of several kinds: per node group, its time over the uniform device's
    (:func:`planner.groups.group_time_scales`); () for one kind."""

    def solver(self, tp: int) -> ilp.Solver:
        if tp not in self.solvers:
            known = None if self.optima is None else self.optima.setdefault(tp, {})
            self.solvers[tp] = ilp.Solver(self.graph, tp, self.collapsed, known)
        return self.solvers[tp]

    @property
    def ilp_solves(self) -> int:
        return sum(s.solves for s in self.solvers.values())


def make_space(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    options: Options,
    facts: MeshFacts | None = None,
    shard_tp: bool = False,
    cuts: stages.Cuts | None = None,
    optima: dict[int, dict] | None = None,
) -> _Space:
    """What every mesh of one search shares (``facts``: what the mesh rules read, by default
    :func:`planner.request.mesh_facts`; ``shard_tp``: the user pinned tp; ``cuts``: where the
    model can be cut into pipeline stages; ``optima``: the ILP answers the caller keeps)."""
    collapsed = ilp.collapse(graph)
    out_bytes, kv_bytes = _layer_out_bytes(graph), _kv_bytes(graph)
    trainable = _trainable_tensors(graph)
    tensors = {x.fqn: len(t) for x, t in zip(graph.layers, trainable, strict=True)}
    experts = {p for m in graph.moes for p in m.expert_params}
    held = _held_inputs(graph, collapsed)
    fsdp_root = tuple(root_unit_layers(graph))  # quadratic in the layers: computed once
    return _Space(
        graph=graph,
        cluster=cluster,
        training=training,
        options=options,
        facts=facts if facts is not None else mesh_facts(graph, cluster, training),
        out_bytes=out_bytes,
        tensors=tensors,
        root_layers=_root_layers(graph, fsdp_root),
        fsdp_root=fsdp_root,
        param_tensors=sum(len(m.params) for m in graph.modules.values()),
        collapsed=collapsed,
        shard_tp=shard_tp,
        optima=optima,
        kv_bytes=kv_bytes,
        cuts=cuts,
        held_inputs=held,
        layer_keys=(keys := _layer_keys(graph, out_bytes, tensors, kv_bytes, held)),
        layer_groups=_layer_groups(graph, collapsed, keys),
        group_scales=group_time_scales(graph, cluster, training.dtype),
        trainable_tensors=tuple(
            tuple((name.rpartition(".")[0], _numel(graph, name), name in experts) for name in layer)
            for layer in trainable
        ),
    )


def _numel(graph: Graph, name: str) -> int:
    module, _, local = name.rpartition(".")
    return graph.modules[module].params[local].numel


def _layer_keys(
    graph: Graph,
    out_bytes: dict[str, int],
    tensors: dict[str, int],
    kv_bytes: dict[str, int],
    held: dict[str, tuple[tuple[str, int], ...]],
) -> tuple[int, ...]:
    """Per layer, a number for everything of the graph its ``LayerCost`` reads
    (planner.score._layer_costs), equal where that is: FLOPs, parameter counts and bytes,
    checkpointed bytes and what a checkpoint holds (named in the ILP's collapsed graph, so
    identical blocks hold the same names), the p2p payload, the optimizer's tensors and the
    K/V bytes. A layer with MoE blocks keys on its name too (expert parallelism reads its MoE
    blocks by name)."""
    whole = (
        (
            x.fwd_flops,
            x.bwd_flops,
            x.param_numel,
            x.param_bytes,
            x.trainable_numel,
            x.saved_bytes_checkpointed,
            x.saved_bytes_checkpointed_autocast,
            out_bytes[x.fqn],
            tensors[x.fqn],
            kv_bytes.get(x.fqn, 0),
            held[x.fqn],
            x.fqn if graph.moes_in(x.fqn) else None,
        )
        for x in graph.layers
    )
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(key, len(ids)) for key in whole)


def _layer_groups(graph: Graph, collapsed: ilp.Collapsed, keys: tuple[int, ...]) -> tuple[int, ...]:
    """Per layer, its group (:attr:`_Space.layer_groups`), numbered in layer order."""
    rep = {f: r for r, fqns in collapsed.members.items() for f in fqns}
    last = len(graph.layers) - 1
    ids: dict[tuple, int] = {}
    return tuple(
        ids.setdefault((keys[i], rep.get(x.fqn, x.fqn), i == last), len(ids))
        for i, x in enumerate(graph.layers)
    )


def _held_inputs(graph: Graph, collapsed: ilp.Collapsed) -> dict[str, tuple[tuple[str, int], ...]]:
    """Layer -> the tensors it reads from outside itself (what a checkpoint of it keeps for the
    recompute; parameters and buffers aside): each as its producer's name in the ILP's collapsed
    graph (a layer of a run of identical layers reads its predecessor's output, whose layout
    the TP solution gives under the first layer's node names) and its bytes at the traced
    batch."""
    rename: dict[str, str] = {}
    for rep, fqns in collapsed.members.items():
        for fqn in fqns:
            rename.update(zip(graph.layer(fqn).nodes, graph.layer(rep).nodes))
    out = {}
    for layer in graph.layers:
        own, held = set(layer.nodes), {}
        for name in layer.nodes:
            for x in graph.node(name).inputs:
                node = graph.node(x)
                if x in own or x in held or node.kind in ("param", "buffer") or node.out is None:
                    continue
                held[x] = (rename.get(x, x), node.out.num_bytes)
        out[layer.fqn] = tuple(held.values())
    return out


def _kv_bytes(graph: Graph) -> dict[str, int]:
    """Layer -> bytes of keys + values read by its SDPA calls at the traced batch."""
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == SDPA_OP:
            k, v = (graph.node(ref).out for ref in n.inputs[1:3])
            out[n.layer] = out.get(n.layer, 0) + k.num_bytes + v.num_bytes
    return out


def fold_cp(mesh: Mesh) -> Mesh:
    """``mesh`` with its cp ranks counted as FSDP shards, for the parameter, gradient and
    optimizer terms: the emitted program shards parameters over fsdp x cp (torchtitan's
    dp_shard_cp), replicated over dp (HSDP)."""
    if mesh.cp == 1:
        return mesh
    return mesh.model_copy(update={"fsdp": mesh.fsdp * mesh.cp, "cp": 1})


@dataclass(frozen=True)
class _Ctx:
    """What every layer cost of one mesh shares."""

    space: _Space
    mesh: Mesh
    axes: list[tuple[str, int]]
    sync_rate: float
    offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state in host memory."""
    cp: int = 1
    """context-parallel degree (``mesh`` is then :func:`fold_cp`'s: cp counted as data ranks)."""
    cp_axes: tuple[tuple[str, int], ...] = ()
    """the unfolded mesh's axes (where the cp group's link is read)."""
    solutions: dict[int, ilp.TPSolution] = field(default_factory=dict, compare=False)
    """local batch -> the ILP's answer (:meth:`solution`), for this mesh's scoring."""

    @property
    def graph(self) -> Graph:
        return self.space.graph

    @property
    def cluster(self) -> Cluster:
        return self.space.cluster

    @property
    def training(self) -> Training:
        return self.space.training

    @property
    def precision(self) -> Precision:
        """The precision regime of this mesh (cost_model.precision: what the trained program
        holds and moves in which dtype)."""
        return precision(self.training.dtype, self.mesh, self.space.options.system)

    def solution(self, batch: int) -> ilp.TPSolution:
        """The ILP's answer for a local batch of ``batch`` samples (its solver caches it)."""
        if batch in self.solutions:
            return self.solutions[batch]
        inputs = ilp.CostInputs(
            tp=self.mesh.tp,
            batch_scale=batch / (self.graph.batch_size * self.cp),
            device=self.cluster.device,
            dtype=self.training.dtype,
            tp_link=axis_link(self.cluster, self.axes, "tp"),
            grad_sync_s_per_byte=self.sync_rate,
            shard_all=self.space.shard_tp and self.mesh.tp > 1,
        )
        sol = self.solutions[batch] = self.space.solver(self.mesh.tp).solve(inputs)
        return sol


def _trainable_tensors(graph: Graph) -> list[list[str]]:
    """Per layer, the FQNs of the trainable parameter tensors of its module and the modules
    under it, in module order (none where the layer is not a module). Each module is placed
    by walking up its dotted path (the root "" last), not by testing every layer against
    every module."""
    at: dict[str, list[int]] = {}
    for i, layer in enumerate(graph.layers):
        if layer.is_module:
            at.setdefault(layer.fqn, []).append(i)
    out: list[list[str]] = [[] for _ in graph.layers]
    for fqn, info in graph.modules.items():
        names = [f"{fqn}.{name}" for name in info.params if name not in info.frozen]
        if not names:
            continue
        path = fqn
        while True:
            for i in at.get(path, ()):
                out[i].extend(names)
            if not path:
                break
            path = path.rpartition(".")[0]
    return out


def _root_layers(graph: Graph, fsdp_root: tuple[str, ...]) -> frozenset[int]:
    """Indices of the layers whose parameters FSDP2's root unit holds, as the emitted program
    wraps them (autopar_runtime.fsdp_units): layers that are not modules, and
    :func:`planner.request.root_unit_layers` (a tied weight, or one read outside its layer:
    FSDP2 manages a tensor in one unit only). Each parameter counts once (``Layer.param_numel``:
    in its first layer). ``fsdp_root``: :func:`planner.request.root_unit_layers`."""
    shared = set(fsdp_root)
    return frozenset(
        i for i, x in enumerate(graph.layers) if not x.is_module or not x.fqn or x.fqn in shared
    )


def _layer_out_bytes(graph: Graph) -> dict[str, int]:
    """Bytes per layer (at the traced batch) that later layers read: the p2p payload when a
    stage boundary follows the layer."""
    order = {layer.fqn: i for i, layer in enumerate(graph.layers)}
    out = dict.fromkeys(order, 0)
    for n in graph.nodes:
        if n.kind != "compute" or n.out is None:
            continue
        later = {
            graph.node(u).layer for u in graph.users[n.name] if graph.node(u).kind == "compute"
        }
        if any(order[x] > order[n.layer] for x in later):
            out[n.layer] += n.out.num_bytes
    return out
