"""Pipeline stages: how the model is cut (torch.export of its forward, a graph of layer calls,
a slice per stage), the same functions the planner runs on meta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .common import Constants, fail, has_submodule
from .launch import local_device

__all__ = [
    "CutError",
    "LayerProgram",
    "forward_mode",
    "MetaGroupedMM",
    "no_cache",
    "unsignable_layers",
    "inlined_layers",
    "export_layers",
    "layer_program",
    "describe",
    "inline_graph",
    "layer_call",
    "layer_of",
    "stage_of_nodes",
    "ContiguousGrad",
    "contiguous_grad",
    "cut_stages",
    "state_sources",
    "split_into_stages",
    "check_split",
    "show_stages",
]


# How the model is cut. Its forward need not be a sequence of children (a GPT adds position
# embeddings at the root and loops over a ModuleList; a Llama slices its rope buffers to the
# sequence; HF models build masks with data-dependent Python), so the cut is made on the graph
# autopar planned on: the model is exported (torch.export, non-strict, at the microbatch shape)
# with the call signature of every planned layer preserved, unflattened back into its module
# hierarchy, and the model's own layer modules are put back in place of their exported copies
# (TP then finds nn.Linear, FSDP and --verify the real parameters under their FQNs). A layer
# called with a string (Gemma 3's rotary embedding, once per attention type) cannot keep its
# signature: such a layer without parameters is inlined like the modules in between (the base
# model, containers): one graph of layer calls and the aten ops between them. A layer call goes
# to the stage that lists the layer. Ops outside layers run as late as they can (in their first
# reader's stage), except that an op reading a non-tensor value (the pytree glue around each
# layer call) runs in that value's stage: only tensors cross stages. Each stage is an
# fx.GraphModule running its slice of the graph: its inputs are the values earlier stages
# computed that it or later stages need (the forward's arguments for stage 0), its outputs those
# later stages need, made contiguous, and its inputs hand their gradients back contiguous: p2p
# sends need contiguous tensors both ways (an LSTM's batch-first output, HF's expanded mask, the
# gradient of a tensor that a torch.cat or a transpose read). It holds the user's module objects
# under their original FQNs (blocks.2.attn.q); state read outside layers (a root-level rope
# buffer or parameter) is its own copy, initialized from the model's (STATE_SOURCES). The
# planner runs the same functions (layer_program, stage_of_nodes, cut_stages) on meta when it
# plans, so a plan it accepts is a plan that cuts. --show-stages prints each stage's code.
class CutError(Exception):
    """The model cannot be cut into the planned stages: one line, what and why."""


@dataclasses.dataclass
class LayerProgram:
    """The forward as one fx graph of layer calls and the ops between them (see above)."""

    root: nn.Module
    graph: torch.fx.Graph
    kinds: dict
    """node name -> the type name of its value, for the values that are no tensor."""


def forward_mode(example_inputs: tuple) -> tuple[contextlib.AbstractContextManager, tuple]:
    """(context, inputs) to run a forward on ``example_inputs``: on meta, under a FakeTensorMode
    (shapes only, like meta, but tensors that tracing-aware code recognizes: HuggingFace's
    masking utils call .item() on a plain meta tensor and skip it on a fake one)."""
    if not any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs):
        return contextlib.nullcontext(), example_inputs
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a shape environment lets data-dependent sizes (a MoE's tokens per expert) stay symbolic
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    inputs = tuple(
        mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
    )
    both = contextlib.ExitStack()
    both.enter_context(mode)
    both.enter_context(MetaGroupedMM())
    return both, inputs


class MetaGroupedMM(torch.utils._python_dispatch.TorchDispatchMode):
    """``aten._grouped_mm`` on meta at any dtype. Its meta kernel follows the CUDA kernel and
    takes bf16 only; the CPU kernel takes fp32 too, and HF's grouped experts (Mixtral,
    Qwen3-MoE) call it at the model's dtype. On meta its shape comes from a bf16 call, returned
    in the dtype the real kernel gives."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].is_meta:
            if args[0].dtype != torch.bfloat16:
                dtype = kwargs.get("out_dtype") or args[0].dtype
                a, b = (x.to(torch.bfloat16) for x in args[:2])
                return func(a, b, *args[2:], **{**kwargs, "out_dtype": None}).to(dtype)
        return func(*args, **kwargs)


def no_cache(model: nn.Module) -> dict:
    """Keyword arguments of every forward the cut runs: no KV cache (an HF model's config may
    ask for one; training never reads it, and a cache object cannot cross stages)."""
    return (
        {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    )


def unsignable_layers(
    model: nn.Module, layers: Iterable[str], example_inputs: tuple
) -> dict[str, str]:
    """The layers called with an argument torch.export cannot keep in a call signature (a
    string, an object) -> that argument, in a few words: one forward, shapes only on meta,
    with hooks on the layers."""
    plain = (torch.Tensor, int, float, bool, type(None))
    found, handles = {}, []

    def hook(fqn):
        def record(module, args, kwargs):
            odd = [
                x
                for x in torch.utils._pytree.tree_leaves((args, kwargs))
                if not isinstance(x, plain)
            ]
            if odd and fqn not in found:
                text = repr(odd[0]) if isinstance(odd[0], str) else "object"
                found[fqn] = f"{type(odd[0]).__name__} {text}"[:80]

        return record

    for fqn in layers:
        handles.append(
            model.get_submodule(fqn).register_forward_pre_hook(hook(fqn), with_kwargs=True)
        )
    mode, inputs = forward_mode(example_inputs)
    try:
        with torch.no_grad(), mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*inputs, **no_cache(model))
    finally:
        for h in handles:
            h.remove()
    return found


def inlined_layers(
    model: nn.Module, layers: Iterable[str], example_inputs: tuple
) -> dict[str, str]:
    """The layers called with a string or an object (unsignable_layers); raises CutError for
    one that holds parameters (it cannot be inlined)."""
    try:
        odd = unsignable_layers(model, layers, example_inputs)
    except Exception as e:  # the user's forward raises many kinds
        raise CutError(
            f"{type(model).__name__}.forward fails on the microbatch ({describe(e)})"
        ) from e
    held = [
        f for f in layers if f in odd and any(True for _ in model.get_submodule(f).parameters())
    ]
    if held:
        raise CutError(
            f"layer {held[0]} is called with a {odd[held[0]]} argument and holds parameters: "
            "torch.export cannot keep a string or an object in a call signature, so a pipeline "
            "stage cannot call it; pass tensors, ints or floats to it, or plan without "
            "pipeline parallelism (--mesh pp=1)"
        )
    return odd


def export_layers(
    model: nn.Module, layers: set, example_inputs: tuple, last_try: bool = False
) -> nn.Module:
    """The unflattened export of the forward with the call signatures of ``layers`` kept;
    raises the export's error, or (``last_try``) CutError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(
                model, example_inputs, no_cache(model), strict=False,
                preserve_module_call_signature=tuple(sorted(layers)),
            )  # fmt: skip
            return torch.export.unflatten(program)
        except Exception as e:  # export raises many kinds
            if not last_try:
                raise
            raise CutError(
                f"cannot export {type(model).__name__} to cut it into pipeline stages "
                f"({describe(e)}): plan without pipeline parallelism (--mesh pp=1)"
            ) from e


def layer_program(model: nn.Module, stages: list[list[str]], example_inputs: tuple) -> LayerProgram:
    """The forward of ``model`` on ``example_inputs`` as a graph of calls of the layers that
    ``stages`` (lists of module FQNs) name; raises CutError where torch.export cannot."""
    layers = [fqn for stage in stages for fqn in stage if fqn and has_submodule(model, fqn)]
    try:
        root = export_layers(model, set(layers), example_inputs)
    except Exception:  # a layer called with a string? find out (one forward) and try again
        layers = set(layers) - set(inlined_layers(model, layers, example_inputs))
        root = export_layers(model, layers, example_inputs, last_try=True)
    layers = set(layers)
    for fqn in layers:
        root.set_submodule(fqn, model.get_submodule(fqn))
    graph = torch.fx.Graph()
    out = inline_graph(root, "", graph, None, layers, skip=set(no_cache(model)))
    graph.output(out[0] if isinstance(out, tuple | list) and len(out) == 1 else out)
    kinds = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if not isinstance(result, torch.Tensor):
                kinds[n.name] = type(result).__name__
            return result

    mode, inputs = forward_mode(example_inputs)
    try:
        with torch.no_grad(), mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Recorder(torch.fx.GraphModule(root, graph)).run(*inputs)
    except Exception as e:  # the user's modules and aten ops, rerun from the export: many kinds
        raise CutError(f"the exported forward does not run as layer calls ({describe(e)})") from e
    return LayerProgram(root, graph, kinds)


def describe(e: BaseException) -> str:
    """An exception in a few words: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def inline_graph(
    module: nn.Module,
    prefix: str,
    graph: torch.fx.Graph,
    args: list,
    layers: set[str],
    skip: Iterable[str] = (),
) -> Any:
    """Copy ``module.graph`` into ``graph``, inlining calls of submodules that are no planned
    layer; return what its output node returns (``args``: values of its placeholders; at the
    top, ``skip``: keyword arguments bound at export, left out)."""
    env, inputs = {}, iter(args or ())
    for n in module.graph.nodes:
        if n.op == "placeholder" and args is None and n.target in skip and not n.users:
            continue
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name) if args is None else next(inputs)
        elif n.op == "output":
            return torch.fx.map_arg(n.args[0], env.__getitem__)
        elif n.op == "call_module" and layer_call(prefix + n.target) not in layers:
            sub_args = torch.fx.map_arg(n.args, env.__getitem__)
            sub = module.get_submodule(n.target)
            env[n] = inline_graph(sub, f"{prefix}{n.target}.", graph, sub_args, layers)
        elif not n.users and "_assert" in getattr(n.target, "__name__", ""):
            continue  # export's checks of the traced dtypes and devices (meta, here)
        elif n.target is operator.getitem and isinstance(env[n.args[0]], tuple | list):
            env[n] = env[n.args[0]][n.args[1]]  # an element of an inlined module's outputs
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op in ("call_module", "get_attr"):
                env[n].target = prefix + n.target
                if n.op == "call_module":  # a second call of a layer (unflatten's layer@1)
                    env[n].target = layer_call(env[n].target)
    raise AssertionError("a graph without output")


def layer_call(target: str) -> str:
    """The module a call_module target calls: unflatten names a module's second call ``m@1``."""
    return ".".join(part.split("@")[0] for part in target.split("."))


def layer_of(fqn: str, layers: Iterable[str]) -> str | None:
    """The planned layer that is the module ``fqn`` or holds it."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    return None


def stage_of_nodes(program: LayerProgram, model: nn.Module, stages: list[list[str]]) -> dict:
    """The stage of every node of ``program`` but the placeholders and the output, for the
    stages ``stages`` (lists of layer FQNs); raises CutError where the cut cannot run."""
    stage_of_layer = {fqn: k for k, layers in enumerate(stages) for fqn in layers}
    holder = {}  # a tied weight (GPT-2's lm_head = wte) cannot live in two stages
    for k, stage_layers in enumerate(stages):
        for fqn in stage_layers:
            if not fqn or not has_submodule(model, fqn):
                continue
            for pname, p in model.get_submodule(fqn).named_parameters():
                if holder.setdefault(id(p), (k, f"{fqn}.{pname}"))[0] != k:
                    raise CutError(
                        f"{fqn}.{pname} is tied to {holder[id(p)][1]} in stage "
                        f"{holder[id(p)][0]}: a pipeline cannot share a weight between stages; "
                        "plan without pipeline parallelism, or untie (tie_word_embeddings=false)"
                    )
    graph = program.graph
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    stage = {}
    for n in nodes:
        layer = layer_of(n.target, stage_of_layer) if n.op == "call_module" else None
        if layer is not None:
            stage[n] = stage_of_layer[layer]
    if not stage:
        raise CutError(f"the forward calls none of the planned layers {sorted(stage_of_layer)}")
    last = len(stages) - 1
    layer_calls = set(stage)
    for n in reversed(nodes):  # the rest as late as it can: in its first reader's stage
        if n not in layer_calls and n.users:
            stage[n] = min((stage[u] for u in n.users if u in stage), default=last)
    for n in nodes:  # an op nothing reads: with what it reads
        if n not in stage:
            stage[n] = max((stage[a] for a in n.all_input_nodes if a in stage), default=0)
    glue = [n for n in nodes if n not in layer_calls]
    for _ in range(len(glue)):  # ... but where a non-tensor value it reads is made
        changed = False
        for n in glue:
            fixed = [stage[a] for a in n.all_input_nodes if a.name in program.kinds and a in stage]
            if fixed and min(fixed) < stage[n]:
                stage[n], changed = min(fixed), True
        for n in reversed(glue):
            earliest = min((stage[u] for u in n.users if u in stage), default=stage[n])
            if earliest < stage[n]:
                stage[n], changed = earliest, True
        if not changed:
            break
    for n in nodes:
        if n.op == "get_attr" and len({stage[u] for u in n.users if u in stage}) > 1:
            readers = sorted({stage[u] for u in n.users if u in stage})
            raise CutError(
                f"{n.target} is read by stages {readers} (tied weights?): a pipeline cannot "
                "share a tensor between stages; plan its readers into one stage"
            )
        for arg in n.all_input_nodes:
            if stage.get(arg, 0) > stage[n]:
                raise CutError(
                    f"the forward runs {n.target} (stage {stage[n]}) after {arg.target} (stage "
                    f"{stage[arg]}): stages must follow the order the forward calls layers in"
                )
            if stage.get(arg, 0) < stage[n] and arg.name in program.kinds:
                k = stage.get(arg, 0)
                raise CutError(
                    f"the cut after {stages[k][-1]} would pass a {program.kinds[arg.name]} "
                    f"({arg.name}) from stage {k} to stage {stage[n]}: pipeline stages pass "
                    "only tensors; cut at another layer boundary"
                )
    empty = sorted(set(range(len(stages))) - {stage[n] for n in layer_calls})
    if empty:
        raise CutError(
            f"pipeline stage {empty[0]} calls no layer: its layers {stages[empty[0]]} hold no "
            "module the forward calls (a layer without parameters called with a string is "
            "inlined); cut at another layer boundary"
        )
    return stage


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (a stage sends the
    gradients of its inputs back with p2p)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return ContiguousGrad.apply(x) if x.is_floating_point() else x


def cut_stages(
    program: LayerProgram, model: nn.Module, stages: list[list[str]], example_inputs: tuple
) -> list[torch.fx.GraphModule]:
    """The model cut into len(stages) modules that, called in a chain, compute its forward
    (checked on ``example_inputs``); raises CutError where the cut cannot run."""
    stage = stage_of_nodes(program, model, stages)
    graph, num_stages = program.graph, len(stages)
    output = next(n for n in graph.nodes if n.op == "output")
    values = [n for n in graph.nodes if n.op != "output"]  # placeholders first, in graph order

    def last_use(value: torch.fx.Node) -> int:
        return max((stage.get(u, num_stages - 1) for u in value.users), default=-1)

    modules, carried = [], [n for n in values if n.op == "placeholder"]
    for k in range(num_stages):
        g = torch.fx.Graph()
        env = {}
        for v in carried:  # stage 0: the forward's own placeholders
            env[v] = g.node_copy(v) if k == 0 else g.placeholder(v.name)
            if k > 0:
                env[v] = g.call_function(contiguous_grad, (env[v],))
        for n in values:
            if stage.get(n) == k:
                env[n] = g.node_copy(n, env.__getitem__)
        if k == num_stages - 1:
            g.output(torch.fx.map_arg(output.args[0], env.__getitem__))
        else:
            carried = [v for v in values if v in env and last_use(v) > k]
            outputs = [g.call_method("contiguous", (env[v],)) for v in carried]
            g.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        module = torch.fx.GraphModule(program.root, g, class_name=f"Stage{k}")
        module.state_sources = state_sources(module, model)
        modules.append(module)
    check_split(model, modules, example_inputs)
    return modules


def state_sources(module: torch.fx.GraphModule, model: nn.Module) -> dict:
    """The stage's own tensors read outside layers (get_attr) -> (the model's module that
    owns the tensor, its name): materialize initializes them from the model's values."""
    out = {}
    for n in module.graph.nodes:
        if n.op == "get_attr":
            owner, _, name = n.target.rpartition(".")
            if has_submodule(model, owner):
                m = model.get_submodule(owner)
                if name in m._parameters or name in m._buffers:
                    out[n.target] = (m, name)
    return out


def split_into_stages(
    c: Constants, model: nn.Module, example_inputs: tuple
) -> list[torch.fx.GraphModule]:
    """The model cut into len(STAGES) modules that, called in a chain, compute its forward."""
    try:
        program = layer_program(model, c.STAGES, example_inputs)
        modules = cut_stages(program, model, c.STAGES, example_inputs)
    except CutError as e:
        fail(str(e))
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs):
        # Exported on meta: ops that create tensors (arange for positions, masks) were recorded
        # with device=meta; they run on this rank's device.
        device = local_device(c)
        for module in modules:
            for n in module.graph.nodes:
                n.args, n.kwargs = torch.fx.node.map_aggregate(
                    (n.args, n.kwargs),
                    lambda a: device if isinstance(a, torch.device) and a.type == "meta" else a,
                )
            module.recompile()
    return modules


def check_split(model: nn.Module, stages: list[nn.Module], example_inputs: tuple) -> None:
    """Run the stages in a chain on one batch, in eval mode, and compare with the forward
    (shapes only on meta, see forward_mode)."""
    training = model.training
    model.eval()
    on_meta = any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs)
    mode, example_inputs = forward_mode(example_inputs)
    leaves = torch.utils._pytree.tree_leaves
    try:
        with torch.no_grad(), mode:
            full = model(*example_inputs, **no_cache(model))
            expected = [x for x in leaves(full) if isinstance(x, torch.Tensor)]
            values = example_inputs
            for k, stage in enumerate(stages):
                out = stage(*values)
                values = out if isinstance(out, tuple) and k < len(stages) - 1 else (out,)
    except Exception as e:  # the cut runs the user's modules and aten ops: many kinds
        raise CutError(f"the pipeline stages do not run in a chain ({describe(e)})") from e
    finally:
        model.train(training)
    got = [x for x in leaves(out) if isinstance(x, torch.Tensor)]
    same = len(got) == len(expected) and all(
        a.shape == b.shape if on_meta else torch.equal(a, b) for a, b in zip(got, expected)
    )
    if not same:
        raise CutError("the pipeline stages in a chain do not compute the model's forward (a bug)")


def show_stages(c: Constants, modules: list[torch.fx.GraphModule]) -> None:
    """--show-stages: rank 0 prints each stage's code; every rank exits 0."""
    if int(os.environ.get("RANK", 0)) == 0:
        for k, module in enumerate(modules):
            print(f"# stage {k}: {c.STAGES[k]}{module.code}")
    sys.exit(0)
