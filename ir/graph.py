"""autopar's graph IR: what the planner knows about a traced model.

The IR is plain frozen data built once by :func:`ir.trace`. It keeps the torch.fx (aten) graph's
structure, so sharding can be propagated op by op, and adds what the cost model needs: shapes,
bytes, FLOPs, parameters read, the module each node came from, and the grouping of nodes into
layers (the units that pipeline stages, FSDP and checkpointing act on).

Conventions:
- node names are the fx node names of the exported program (unique, stable within one trace);
- ``args`` mirror the fx node's args with every node reference replaced by :class:`Ref` and lists
  turned into tuples, so the IR holds no torch objects;
- module FQNs are the user's original names (``blocks.0.attn.q``), ``""`` for the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

NodeKind = Literal["input", "param", "buffer", "compute", "output"]

_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name without the ``torch.`` prefix."""
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Ref:
    """A reference, inside ``Node.args``, to the output of another node."""

    name: str


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class Node:
    """One node of the traced graph."""

    name: str
    """fx node name, unique in the graph."""
    kind: NodeKind
    """input: a user input; param/buffer: a module parameter/buffer; compute: an op; output."""
    op: str
    """the op: ``aten.linear.default``, ``getitem``, ...; for input/param/buffer/output, the kind."""
    args: tuple[Any, ...]
    """fx args, node references as :class:`Ref`, lists as tuples."""
    kwargs: tuple[tuple[str, Any], ...]
    """fx kwargs as sorted (key, value) pairs, node references as :class:`Ref`."""
    outputs: tuple[TensorMeta | None, ...]
    """one entry per output value (one for a single tensor); None where a value is not a tensor."""
    module_stack: tuple[str, ...]
    """FQNs of the modules this node ran inside, outermost first (empty for root-level ops)."""
    module_type: str
    """qualified class name of the innermost module (the root's class for root-level ops)."""
    layer: str
    """FQN of the layer this node belongs to (see :class:`Layer`)."""
    fwd_flops: int = 0
    """floating point operations of the forward op at the traced batch."""
    bwd_flops: int = 0
    """floating point operations of its backward (gradient w.r.t. inputs and weights)."""
    params: tuple[str, ...] = ()
    """FQNs of the parameters this node reads directly (for param nodes: the parameter itself)."""
    source: str | None = None
    """the user's source line that produced the node, ``file:line: code``, where known."""
    saved_bytes: int = 0
    """bytes autograd saved for backward while this op ran, measured (see ``Layer.saved_bytes``):
    storages first saved by this node, parameters excluded."""
    saved_bytes_autocast: int | None = None
    """the same under ``torch.autocast(bf16)`` over fp32 parameters (``Layer.saved_bytes_autocast``);
    None where not measured (a trace at fp32, or already under autocast): ``saved_bytes``."""

    def saved(self, autocast: bool = False) -> int:
        """Bytes saved for backward: under autocast where ``autocast`` and measured."""
        return _pick(self.saved_bytes, self.saved_bytes_autocast, autocast)

    @property
    def module_fqn(self) -> str:
        """FQN of the innermost module, ``""`` for root-level ops."""
        return self.module_stack[-1] if self.module_stack else ""

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        """Names of the nodes whose outputs this node reads, in argument order."""
        names: list[str] = []
        _ref_names(self.args, names)
        for _, v in self.kwargs:
            _ref_names(v, names)
        return tuple(names)

    @property
    def out(self) -> TensorMeta | None:
        """The single output's meta (first output for multi-output ops)."""
        return self.outputs[0] if self.outputs else None


def _pick(plain: int, under_autocast: int | None, autocast: bool) -> int:
    return under_autocast if autocast and under_autocast is not None else plain


def _ref_names(value: Any, out: list[str]) -> None:
    """Append the name of every Ref in ``value`` (nested tuples, lists, dicts) to ``out``, in
    order."""
    if isinstance(value, Ref):
        out.append(value.name)
    elif isinstance(value, tuple | list):
        for v in value:
            if isinstance(v, Ref):
                out.append(v.name)
            elif isinstance(v, tuple | list | dict):
                _ref_names(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _ref_names(v, out)


@dataclass(frozen=True)
class ModuleInfo:
    """A module of the model, as seen at trace time."""

    fqn: str
    type: str
    """qualified class name, e.g. ``torch.nn.modules.linear.Linear``."""
    params: dict[str, TensorMeta]
    """direct parameters (not recursive), local name -> meta."""
    int_attrs: dict[str, int]
    """public int attributes (``in_features``, ``n_head``, ``num_heads``...), for codegen fix-ups."""
    children: tuple[str, ...]
    """FQNs of the direct children."""
    frozen: tuple[str, ...] = ()
    """direct parameters (local names) with ``requires_grad=False``: no gradient, no optimizer
    state, no gradient communication."""


@dataclass(frozen=True)
class Layer:
    """A unit of the model that stages, FSDP wrapping and checkpointing act on.

    Layers are the top-most modules that hold no repeated container (the blocks of a ModuleList,
    the embedding, the final norm, the head); root-level ops attach to the preceding layer.
    """

    fqn: str
    """module FQN of the layer; a root-level pseudo-layer has a name that is not a module FQN."""
    is_module: bool
    """whether ``fqn`` names a real module (FSDP/checkpoint can wrap it)."""
    nodes: tuple[str, ...]
    """compute nodes of this layer, in topological order."""
    signature: str
    """structural signature: layers with equal signatures are identical blocks."""
    param_numel: int
    param_bytes: int
    """every parameter the layer owns (at the traced dtype), trainable or frozen."""
    fwd_flops: int
    bwd_flops: int
    activation_bytes: int
    """an estimate of the bytes saved for backward at the traced batch: every non-view output of
    the layer's nodes. Kept for its users; ``saved_bytes`` is the measured figure."""
    saved_bytes: int = 0
    """bytes autograd really saves for backward in this layer's forward, measured on meta at the
    traced batch and dtype (see ``ir._saved``): distinct storages (a view and its base once, a
    tensor saved by two ops once, charged to the first), parameters and buffers excluded."""
    saved_bytes_checkpointed: int = 0
    """bytes that stay saved with this layer under activation checkpointing: its inputs (the
    distinct non-parameter tensors its nodes read from outside it), which the checkpoint holds for
    the recompute; the transient of the recompute itself is ``saved_bytes`` again."""
    frozen_numel: int = 0
    """of ``param_numel``: parameters with ``requires_grad=False`` (a frozen embedding or
    backbone). They are held, gathered and read like the others, but get no gradient, no
    optimizer state and no gradient reduction."""
    frozen_bytes: int = 0
    """of ``param_bytes``: the frozen parameters' bytes."""
    saved_bytes_autocast: int | None = None
    """``saved_bytes`` under ``torch.autocast(bf16)`` over fp32 parameters, the emitted program's
    bf16 regime where FSDP2 does not apply (fp32 residual stream, norms and dropout masks, a bf16
    copy of each matmul input per call: ``ir._saved``), measured beside ``saved_bytes`` when the
    trace runs at bf16; None where not measured (``saved_bytes`` then stands for it)."""
    saved_bytes_checkpointed_autocast: int | None = None
    """``saved_bytes_checkpointed`` under autocast (the layer's inputs, fp32 where the residual
    stream is); None where not measured."""

    def saved(self, autocast: bool = False) -> int:
        """Bytes saved for backward in this layer's forward: under autocast where ``autocast``
        and measured."""
        return _pick(self.saved_bytes, self.saved_bytes_autocast, autocast)

    def saved_checkpointed(self, autocast: bool = False) -> int:
        """Bytes held with the layer checkpointed: under autocast where ``autocast`` and
        measured."""
        return _pick(
            self.saved_bytes_checkpointed, self.saved_bytes_checkpointed_autocast, autocast
        )

    @property
    def trainable_numel(self) -> int:
        return self.param_numel - self.frozen_numel

    @property
    def trainable_bytes(self) -> int:
        return self.param_bytes - self.frozen_bytes


@dataclass(frozen=True)
class PositionTable:
    """An embedding table the forward indexes by token position (``ir._positions``): a learned
    absolute position embedding (nanoGPT's ``wpe``, BERT's ``position_embeddings``). Token ``t``
    of a sequence reads row ``first + t``, so a sequence longer than ``rows - first`` reads past
    the table: on meta tensors nothing fails, on real ones the lookup does."""

    fqn: str
    """the embedding module (``pos_emb``, ``transformer.wpe``)."""
    rows: int
    """rows of its weight (``num_embeddings``)."""
    first: int
    """the row token 0 reads (OPT and BART offset their positions by 2, RoBERTa past its padding
    row)."""
    setting: str | None = None
    """the config key that sizes the table, where one does (an HF config's ``n_positions``)."""
    setting_value: int | None = None
    """that key's value (one more of it is one more row)."""

    @property
    def max_seq_len(self) -> int:
        """The longest sequence whose positions stay inside the table."""
        return self.rows - self.first


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts block found in the graph (see ``ir._moe``)."""

    fqn: str
    """the innermost module holding the router's gate and the experts (``blocks.0.moe``)."""
    layer: str
    """the layer the block runs in."""
    router: str
    """module FQN of the gate whose scores the top-k picks from."""
    topk_node: str
    """the ``topk`` node that routes."""
    experts: tuple[str, ...]
    """module FQNs of the experts: one per expert (a ModuleList's children), or the one module
    holding stacked expert weights (``grouped``)."""
    expert_params: tuple[str, ...]
    """FQNs of every expert parameter."""
    grouped: bool
    """expert weights stacked in parameters whose first dim is ``num_experts``."""
    num_experts: int
    top_k: int
    tokens: int
    """tokens routed at the traced batch (each to ``top_k`` experts)."""
    hidden: int
    """elements of one dispatched token (the experts' input width)."""
    expert_param_numel: int
    expert_param_bytes: int
    expert_fwd_flops: int
    """FLOPs of the expert nodes at the traced batch, routing taken as balanced."""
    expert_bwd_flops: int
    aux_loss: bool
    """a load-balancing loss (a scalar depending on the routing) reaches the output."""
    rows: int = 0
    """rows the experts of a module list receive in all at the traced batch, each expert's
    input rows summed: ``tokens * top_k`` where the routing picks them (a data-dependent count,
    traced at the balanced share), ``tokens * num_experts`` where every expert runs on every
    token (dense dispatch). 0 where not read (stacked experts): ``tokens * top_k`` is assumed."""

    @property
    def fanout(self) -> float:
        """Expert rows per routed token: what one token costs the dispatch all-to-all."""
        return self.rows / self.tokens if self.rows and self.tokens else float(self.top_k)

    @property
    def dense(self) -> bool:
        """Every expert runs on every token: no routing decides the rows, so no rank gets more
        of them than another."""
        return self.rows >= self.tokens * self.num_experts > 0


@dataclass(frozen=True)
class LayerCalls:
    """How the forward calls its layers, as torch.export keeps the calls (``ir.trace`` exports
    with every layer's call signature preserved): the facts that decide where the model can be
    cut into pipeline stages (``autopar._cuts``)."""

    odd_args: dict[str, str] = field(default_factory=dict)
    """layer FQN -> its first argument that is no tensor, int, float, bool or None (a string,
    an object), in a few words (``str 'sliding'``): torch.export cannot keep it in a call
    signature."""
    unread_args: dict[str, str] = field(default_factory=dict)
    """layer FQN -> the node of a tensor it is called with that no op of the forward reads (a
    mask the layer ignores): torch.export drops such a value from the layer's call."""
    error: str | None = None
    """why torch.export cannot keep the layers' call signatures at all (its error, in a few
    words), or None."""
    shared_state: dict[str, str] = field(default_factory=dict)
    """parameter or buffer FQN -> the FQN of the same tensor that the graph names it by, for
    tensors with several names (a head tied to the embedding: ``head.weight`` -> ``tok_emb.weight``)."""


@dataclass(frozen=True)
class Graph:
    """A traced model: nodes in topological order, modules, layers."""

    nodes: tuple[Node, ...]
    modules: dict[str, ModuleInfo]
    layers: tuple[Layer, ...]
    batch_size: int
    """batch size of the example inputs used to trace; per-sample costs scale from it."""
    seq_len: int | None
    """sequence length of the example inputs, where the model takes sequences."""
    root_type: str
    """qualified class name of the model."""
    saved_for: str = "cuda"
    """the device type whose kernels the saved-bytes measurement follows (``cuda`` or ``cpu``)."""
    moes: tuple[MoE, ...] = ()
    """the mixture-of-experts blocks, in model order (``ir._moe``)."""
    positions: tuple[PositionTable, ...] = ()
    """the embedding tables the forward indexes by token position (``ir._positions``)."""
    local_literals: dict[str, dict[int, tuple[int, ...]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """view/reshape/expand node -> tp -> the sizes it takes on local heads, where running its
    attention block at a Megatron pair's local shapes proved them (``ir._heads``)."""
    dtensor_blocks: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)
    """FQNs of attention blocks whose views name full sizes that no local rewrite makes right
    (nanoGPT's ``C // self.n_head``, a head count written as a number): under a Megatron pair
    the emitted program runs their inner ops on DTensors of full shape (``ir._heads``)."""
    fused_linears: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """linear FQN -> k, for the linears of those blocks whose output is split into k equal pieces
    along its last dim (nanoGPT's fused ``c_attn``): each rank holds its slice of every piece."""
    fused_heads: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)
    """linear FQN -> the tp degrees at which its attention block ran it fused (HF Falcon's
    ``query_key_value``: its first ``in_features`` rows the query heads, split over tp, its
    other rows kv heads every rank computes whole; ``ir._heads``)."""
    fused_blocks: dict[str, tuple[int, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """attention block FQN -> the tp degrees at which its fused q/k/v projection can be split
    (Megatron's pairs, or run fused: ``fused_heads``); at any other tp it would stay whole
    (``ir._heads.fused_blocks``)."""
    grouped_kv: dict[str, dict[int, int]] = field(default_factory=dict, compare=False, repr=False)
    """kv linear FQN -> tp -> its block's kv heads, at the degrees (above them) where the block
    runs with each rank computing the one kv head its query heads read (``ir._heads``)."""
    gqa_blocks: dict[str, tuple[int, int, str]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """attention block FQN -> (query heads, kv heads, its output linear's FQN), for the blocks
    whose kv projections are narrower than their query projection (``ir._heads``)."""
    calls: LayerCalls | None = field(default=None, compare=False, repr=False)
    """how the forward calls its layers (pipeline cuts); None for a graph built without them."""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({n.name: i for i, n in enumerate(self.nodes)})

    def node(self, name: str) -> Node:
        return self.nodes[self._index[name]]

    def layer(self, fqn: str) -> Layer:
        return self.layers[self._layer_index[fqn]]

    @cached_property
    def _layer_index(self) -> dict[str, int]:
        """layer FQN -> its place (the first, where two share one)."""
        out: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            out.setdefault(layer.fqn, i)
        return out

    @cached_property
    def grouped_kv_by_block(self) -> dict[str, tuple[dict[int, int], ...]]:
        """:attr:`grouped_kv` by block (each kv linear's parent), in its order."""
        out: dict[str, list[dict[int, int]]] = {}
        for fqn, degrees in self.grouped_kv.items():
            out.setdefault(fqn.rpartition(".")[0], []).append(degrees)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        """node name -> names of the nodes that read it."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def num_params(self) -> int:
        return sum(layer.param_numel for layer in self.layers)

    @cached_property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @cached_property
    def trainable_numel(self) -> int:
        """parameters that get gradients and optimizer state (``requires_grad=True``)."""
        return sum(layer.trainable_numel for layer in self.layers)

    @cached_property
    def trainable_param_tensors(self) -> int:
        """parameter tensors that get gradients (every module's direct trainable parameters)."""
        return sum(len(m.params) - len(m.frozen) for m in self.modules.values())

    @cached_property
    def fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @cached_property
    def bwd_flops(self) -> int:
        return sum(n.bwd_flops for n in self.nodes)

    def moes_in(self, layer: str) -> tuple[MoE, ...]:
        """The mixture-of-experts blocks that run in ``layer``."""
        return tuple(m for m in self.moes if m.layer == layer)

    @cached_property
    def routed_nodes(self) -> frozenset[str]:
        """Nodes that run inside a mixture-of-experts block (their rows are routed tokens)."""
        blocks = {m.fqn for m in self.moes}
        return frozenset(n.name for n in self.nodes if blocks.intersection(n.module_stack))

    @cached_property
    def expert_param_numel(self) -> int:
        return sum(m.expert_param_numel for m in self.moes)

    def distinct_layers(self) -> dict[str, list[str]]:
        """signature -> FQNs of the layers that share it, in model order."""
        out: dict[str, list[str]] = {}
        for layer in self.layers:
            out.setdefault(layer.signature, []).append(layer.fqn)
        return out

    def to_networkx(self) -> Any:
        """The data-flow graph as a networkx DiGraph (node name -> Node in attribute ``node``)."""
        import networkx as nx

        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, node=n)
            for i in n.inputs:
                g.add_edge(i, n.name)
        return g
