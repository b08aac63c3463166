"""The profile's microbenchmarks, run on every rank under torchrun (``python -m
autopar.cost_model.profile --worker``): matmuls, elementwise ops, attention, the eager-op floor,
tiny training steps plain and tensor-parallel, reference blocks, and every collective over
every group size; what each times is :mod:`cost_model.profile`'s docstring.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

from autopar.cost_model.profile_data import COLLECTIVES


def _sizes(quick: bool, kind: str, is_gpu: bool) -> list:
    if kind == "matmul":
        squares = [64, 128, 256, 512] if quick else [32, 64, 128, 256, 512, 768, 1024]
        if is_gpu:
            squares = [256, 1024, 2048, 4096] if quick else [256, 512, 1024, 2048, 4096, 8192]
        shapes = [(n, n, n) for n in squares]
        # transformer-like: many tokens against a narrow hidden size
        shapes += [(2048, 64, 256), (2048, 256, 64)] if not is_gpu else [(16384, 4096, 4096)]
        return shapes
    if kind == "elementwise":
        exps = [10, 14, 18, 22] if quick else [10, 12, 14, 16, 18, 20, 22, 24]
        if is_gpu:
            exps = [16, 20, 24, 28] if quick else [14, 16, 18, 20, 22, 24, 26, 28]
        return [2**e for e in exps]
    if kind == "sdpa":
        seqs = [64, 256] if quick else [64, 128, 256, 512]
        if is_gpu:
            seqs = [512, 2048] if quick else [512, 1024, 2048, 4096]
        return [(2, 4, s, d) for s in seqs for d in (16, 64)]
    if kind == "collective":
        top = 24 if quick else 28  # 16 MB / 256 MB
        step = 5 if quick else 2
        return [2 ** (10 + i) for i in range(0, top - 10 + 1, step)] + ([2**24] if quick else [])
    raise ValueError(kind)


class _Progress:
    """A progress display on stderr (rank 0): rich's bar if installed, else a plain line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from rich.progress import Progress

                self._bar = Progress(transient=False)
                self._bar.start()
                self._task = self._bar.add_task("profiling", total=total)
            except ImportError:
                self._bar = None

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"profiling {what:<28}")
        else:
            print(f"\rprofiling [{self.done}/{self.total}] {what:<40}", end="", file=sys.stderr)
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.stop()
            else:
                print(file=sys.stderr)


class _Worker:
    def __init__(self, quick: bool) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.quick = quick
        self.is_gpu = torch.cuda.is_available()
        if self.is_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda")
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        timeout = _dt.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", 300)))
        dist.init_process_group(backend, timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.samples: list[dict] = []
        self.budget_s = 0.15 if quick else 0.4  # timed seconds per point, about

    def sync(self) -> None:
        if self.is_gpu:
            self.torch.cuda.synchronize()

    def _agree(self, value: float) -> float:
        """The max of ``value`` over the ranks (so every rank runs as many repeats)."""
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def _mean(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return float(t.item()) / self.world

    def time(
        self,
        fn,
        group=None,
        inner: int = 1,
        typical=statistics.median,
        paced: bool = False,
        min_reps: int = 3,
    ) -> tuple[float, int]:
        """Seconds of one call of ``fn`` (``inner`` calls per timed repeat), ``typical`` (the
        median) of repeats sized to the budget; every rank runs the same repeats; averaged over
        ranks. ``paced``: every repeat starts together on all ranks (a barrier) and counts as
        long as its slowest rank took, as a step that ends in a collective does: every rank
        waits there for the last (benchmarks/ddp_in_step.py: 1.5 ms at an all-reduce right after
        a 26-ms backward on 2 gloo ranks). At least ``min_reps`` repeats, whatever the
        budget."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        first = self._agree(time.perf_counter() - t0)
        reps = int(min(50 if self.quick else 100, max(min_reps, self.budget_s / max(first, 1e-7))))
        if inner == 1 and first < 2e-4:
            inner = int(min(1000, max(1, 2e-3 / max(first, 1e-7))))
        times = []
        for _ in range(reps):
            if group is not None or paced:
                self.dist.barrier(group=group)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            times.append((time.perf_counter() - t0) / inner)
        if paced:
            slowest = self.torch.tensor(times, dtype=self.torch.float64, device=self.device)
            self.dist.all_reduce(slowest, op=self.dist.ReduceOp.MAX)
            return float(typical(slowest.tolist())), reps
        return self._mean(typical(times)), reps

    def add(self, **kw) -> None:
        self.samples.append(kw)

    # -- compute
    def matmul(self, progress: _Progress) -> None:
        torch = self.torch
        for dtype in ("fp32", "bf16"):
            tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
            for m, k, n in _sizes(self.quick, "matmul", self.is_gpu):
                a = torch.randn(m, k, device=self.device, dtype=tdt)
                b = torch.randn(k, n, device=self.device, dtype=tdt)
                out = torch.empty(m, n, device=self.device, dtype=tdt)
                t, reps = self.time(lambda a=a, b=b, out=out: torch.mm(a, b, out=out))
                self.add(bench="matmul", op="mm", dtype=dtype, shape=[m, k, n],
                         flops=2.0 * m * k * n, time_s=t, reps=reps)  # fmt: skip
                progress.step(f"matmul {dtype} {m}x{k}x{n}")

    def elementwise(self, progress: _Progress) -> None:
        torch = self.torch
        for numel in _sizes(self.quick, "elementwise", self.is_gpu):
            x = torch.randn(numel, device=self.device)
            y, z = torch.randn_like(x), torch.empty_like(x)
            t, reps = self.time(lambda x=x, y=y, z=z: torch.add(x, y, out=z))
            self.add(bench="elementwise", op="add", shape=[numel], bytes=3.0 * 4 * numel,
                     flops=float(numel), time_s=t, reps=reps)  # fmt: skip
            progress.step(f"add {numel * 4 // 1024} KB")

    def sdpa(self, progress: _Progress) -> None:
        torch = self.torch
        F = torch.nn.functional
        dtype = "bf16" if self.is_gpu else "fp32"
        tdt = torch.bfloat16 if self.is_gpu else torch.float32
        for b, h, s, d in _sizes(self.quick, "sdpa", self.is_gpu):
            q, k, v = (torch.randn(b, h, s, d, device=self.device, dtype=tdt) for _ in range(3))
            t, reps = self.time(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            )
            self.add(bench="sdpa", op="sdpa", dtype=dtype, shape=[b, h, s, d],
                     flops=4.0 * b * h * s * s * d, time_s=t, reps=reps)  # fmt: skip
            progress.step(f"sdpa s={s} d={d}")

    def overhead(self, progress: _Progress) -> None:
        torch = self.torch
        a, b, c = torch.ones(4, device=self.device), torch.ones(4, device=self.device), None
        c = torch.empty(4, device=self.device)
        t, reps = self.time(lambda: torch.add(a, b, out=c), inner=2000)
        self.add(bench="eager_op", op="add", shape=[4], time_s=t, reps=reps)
        progress.step("eager op")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        dev_type = "cuda" if self.is_gpu else "cpu"
        mesh = init_device_mesh(dev_type, (self.world, 1), mesh_dim_names=("dp", "tp"))
        from torch.distributed.tensor import Shard, distribute_tensor

        for dt in (False, True):
            params = []
            for _ in range(OPT_TENSORS):
                w = torch.randn(*OPT_TENSOR_SHAPE, device=self.device)
                if dt:  # sharded over every rank, as FSDP2 holds parameters
                    w = distribute_tensor(w, mesh["dp"], [Shard(0)])
                params.append(torch.nn.Parameter(w))
            for q in params:
                q.grad = torch.ones_like(q)
            opt = torch.optim.AdamW(params, lr=1e-4)
            t, reps = self.time(opt.step)
            self.add(bench="train_step", op="adamw_dtensor" if dt else "adamw",
                     shape=[OPT_TENSORS], time_s=t, reps=reps)  # fmt: skip
            progress.step(f"adamw{' dtensor' if dt else ''}")
        for depth in MLP_DEPTHS:
            for tp in (False, True):
                torch.manual_seed(0)
                model = tiny_mlp(depth, MLP_WIDTH).to(self.device)
                if tp:
                    parallelize_module(model, mesh["tp"], _tiny_mlp_tp_plan(depth))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                x = mlp_input(self.device)

                def forward_backward(model=model, x=x) -> None:
                    model.zero_grad(set_to_none=True)  # backward allocates, as in a step
                    model(x).square().mean().backward()

                def step(opt=opt, forward_backward=forward_backward) -> None:
                    forward_backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                # the forward + backward alone (op_overhead_s: ops with autograd recording),
                # then the whole step (with AdamW's ops, which cost less each)
                for op, run in (("mlp_fb", forward_backward), ("mlp", step)):
                    for _ in range(3):
                        run()
                    t, reps = self.time(run)
                    self.add(bench="train_step", op=op + ("_tp" if tp else ""),
                             shape=[depth, MLP_WIDTH], time_s=t, reps=reps)  # fmt: skip
                progress.step(f"mlp step depth {depth}{' tp' if tp else ''}")
            if self.world > 1:  # TP over every rank: the same with its collectives
                self._tp_world(depth, progress)
        self.checkpointing(progress)
        self.pipeline(progress)

    def _tp_world(self, depth: int, progress: _Progress) -> None:
        """The tiny MLP's forward + backward with its linears tensor-parallel over every rank
        (``mlp_fb_tp_world``): against the one-rank mesh's, what its collectives cost in a step
        (``tp_collective_overhead_s``, beyond their fitted time)."""
        torch = self.torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cuda" if self.is_gpu else "cpu", (self.world,))
        torch.manual_seed(0)
        model = tiny_mlp(depth, MLP_WIDTH).to(self.device)
        parallelize_module(model, mesh, _tiny_mlp_tp_plan(depth))
        x = mlp_input(self.device)

        def forward_backward() -> None:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

        for _ in range(3):
            forward_backward()
        t, reps = self.time(forward_backward, paced=True)
        self.add(bench="train_step", op="mlp_fb_tp_world", shape=[depth, MLP_WIDTH],
                 group_size=self.world, time_s=t, reps=reps)  # fmt: skip
        progress.step(f"mlp fwd+bwd depth {depth} tp over {self.world}")

    def checkpointing(self, progress: _Progress) -> None:
        """The tiny MLP's forward + backward with every block checkpointed as the emitted
        program wraps layers (``checkpoint_wrapper``), and its forward alone with autograd
        recording (what the recompute runs): what a checkpointed layer costs beyond its
        recomputed forward (``checkpoint_layer_s``)."""
        torch = self.torch
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for depth in MLP_DEPTHS:
            torch.manual_seed(0)
            model = tiny_mlp(depth, MLP_WIDTH).to(self.device)
            x = mlp_input(self.device)

            def forward(model=model, x=x) -> None:
                model(x)  # the graph is recorded, then freed with the output

            wrapped = tiny_mlp(depth, MLP_WIDTH).to(self.device)
            for i, block in enumerate(wrapped.blocks):
                wrapped.blocks[i] = checkpoint_wrapper(block)

            def checkpointed(model=wrapped, x=x) -> None:
                model.zero_grad(set_to_none=True)
                model(x).square().mean().backward()

            for op, run in (("mlp_fwd", forward), ("mlp_fb_ckpt", checkpointed)):
                for _ in range(3):
                    run()
                t, reps = self.time(run)
                self.add(bench="train_step", op=op, shape=[depth, MLP_WIDTH], time_s=t,
                         reps=reps)  # fmt: skip
            progress.step(f"mlp checkpointed depth {depth}")

    def pipeline(self, progress: _Progress) -> None:
        """A step of torch's 1F1B schedule over two stages, each the tiny MLP of depth 1 (its
        time is the runtime's: a microbatch's compute is a few ops), at each of
        ``PP_MICROBATCHES``, on rank pairs (``pipeline_action_s``). Every rank runs it (the
        timing agrees over the world); a world that pairs up evenly only."""
        if self.world < 2 or self.world % 2:
            return
        torch, dist = self.torch, self.dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        group, _ = dist.new_subgroups(2)
        me = dist.get_process_group_ranks(group).index(self.rank)
        for m in PP_MICROBATCHES:
            torch.manual_seed(0)
            stage_module = tiny_mlp(1, MLP_WIDTH).to(self.device)
            stage = PipelineStage(stage_module, me, 2, self.device, group=group)
            schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: out.square().mean())
            x = mlp_input(self.device, m)

            def step(schedule=schedule, module=stage_module, x=x) -> None:
                if me == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=x, losses=[])
                module.zero_grad(set_to_none=True)

            for _ in range(2):
                step()
            t, reps = self.time(step, group=group, min_reps=PP_MIN_REPS)
            self.add(bench="pipeline", op="1f1b", shape=[m, MLP_WIDTH, MLP_BATCH],
                     group_size=2, time_s=t, reps=reps)  # fmt: skip
            progress.step(f"pipeline 1f1b m={m}")

    def block(self, progress: _Progress) -> None:
        """Forward + backward of the reference transformer block at two depths (no optimizer:
        the step's compute as the planner's compute term counts it), plain and, with more
        than one rank, data-parallel over every rank under DDP (also with a comm hook that
        reduces nothing: DDP's own work) and FSDP2; paced by the slowest
        rank (:meth:`time`), as every step of a multi-rank plan is."""
        torch = self.torch
        dim, heads, batch, seq, dtype = block_shape(self.is_gpu)
        name = "bf16" if dtype == "bfloat16" else "fp32"
        wraps = (None, "ddp", "ddp_noop", "fsdp") if self.world > 1 else (None,)
        narrow = block_narrow_dim(self.is_gpu)
        runs = [(d, dim, batch, w) for d in BLOCK_DEPTHS for w in wraps]
        # plain at a narrow width (the same ops, a fraction of the FLOPs), at the batch and at
        # one sample (the same ops, a fraction of the rows): compute_scale, op_overhead_s and
        # op_row_s apart (profile_fit._fit_compute_scale)
        runs += [(d, narrow, b, None) for b in (batch, 1) for d in BLOCK_DEPTHS]
        for depth, width, rows, wrap in runs:
            x = torch.randn(rows, seq, width, device=self.device, dtype=getattr(torch, dtype))
            step = self._block_step(wrap, depth, width, heads, x)
            t, reps = self.time(step, paced=True, min_reps=BLOCK_MIN_REPS)
            self.add(bench="train_step", op="block" if wrap is None else f"block_{wrap}",
                     dtype=name, shape=[depth, width, heads, rows, seq],
                     group_size=1 if wrap is None else self.world, time_s=t, reps=reps)  # fmt: skip
            progress.step(f"block fwd+bwd depth {depth} width {width} batch {rows}"
                          f"{f' {wrap}' if wrap else ''}")  # fmt: skip

    def _block_step(self, wrap: str | None, depth: int, dim: int, heads: int, x):
        """One warmed-up fwd+bwd step of the reference block, wrapped in DDP / FSDP2 or not."""
        torch = self.torch
        torch.manual_seed(0)
        model = reference_block(depth, dim, heads).to(self.device, x.dtype)
        if wrap in ("ddp", "ddp_noop"):
            model = torch.nn.parallel.DistributedDataParallel(model)
        if wrap == "ddp_noop":  # DDP's own work: hooks and buckets, nothing reduced

            def reduce_nothing(state, bucket):
                done = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done

            model.register_comm_hook(None, reduce_nothing)
        elif wrap == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cuda" if self.is_gpu else "cpu", (self.world,))
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)

        def step() -> None:
            model(x).float().square().mean().backward()
            for q in model.parameters():
                q.grad = None

        for _ in range(3):
            step()
        return step

    # -- communication
    def collectives(self, progress: _Progress) -> None:
        torch, dist = self.torch, self.dist
        sizes = _sizes(self.quick, "collective", self.is_gpu)
        for g in group_sizes(self.world):
            group, _ = dist.new_subgroups(g)
            for kind in COLLECTIVES:
                if kind == "send_recv" and g != 2:
                    continue
                for nbytes in sizes:
                    fn = self._collective(kind, nbytes, g, group)
                    t, reps = self.time(fn, group=group, typical=trimmed_mean)
                    self.add(bench="collective", op=kind, group_size=g, bytes=float(nbytes),
                             time_s=t, reps=reps)  # fmt: skip
                    progress.step(f"{kind} n={g} {_human(nbytes)}")
                    del fn
        del torch

    def _collective(self, kind: str, nbytes: int, g: int, group):
        torch, dist = self.torch, self.dist
        numel = max(g, nbytes // 4 // g * g)
        x = torch.ones(numel, device=self.device)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(x, group=group)
        if kind == "all_gather":
            part = x[: numel // g].clone()
            return lambda: dist.all_gather_into_tensor(x, part, group=group)
        if kind == "reduce_scatter":
            part = torch.empty(numel // g, device=self.device)
            return lambda: dist.reduce_scatter_tensor(part, x, group=group)
        if kind == "all_to_all":
            out = torch.empty_like(x)
            return lambda: dist.all_to_all_single(out, x, group=group)
        if kind == "send_recv":
            ranks = dist.get_process_group_ranks(group)
            me = ranks.index(self.rank)
            peer = ranks[1 - me]
            if me == 0:
                return lambda: dist.send(x, dst=peer)
            return lambda: dist.recv(x, src=peer)
        raise ValueError(kind)

    def finish(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


MLP_DEPTHS = (1, 6)
PP_MICROBATCHES = (2, 8)
# repeats of each pipeline step at least: the quick sweep's budget gave the 8-microbatch step 7-8
# (2026-12-06's profiles), and pipeline_action_s leans on it (18 of its 24 actions)
PP_MIN_REPS = 20
MLP_WIDTH = 16
MLP_BATCH = 8
MLP_SEQ = 2
"""the tiny MLP's MLP_BATCH rows are fed as (MLP_BATCH / MLP_SEQ, MLP_SEQ, MLP_WIDTH): rank-3
activations, as transformer blocks take them, whose linears launch more ops each than on rank 2
(a view before and after the matmul, forward and backward)."""


def mlp_input(device, microbatches: int = 1):
    """The tiny MLP benchmarks' input: ``microbatches`` of MLP_BATCH rows, rank 3 (MLP_SEQ)."""
    import torch

    return torch.randn(microbatches * MLP_BATCH // MLP_SEQ, MLP_SEQ, MLP_WIDTH, device=device)


OPT_TENSORS = 16
OPT_TENSOR_SHAPE = (64, 16)  # each AdamW benchmark tensor's


def tiny_mlp(depth: int, width: int):
    """The residual MLP the overhead benchmark trains (tiny: its time is all op overhead)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return MLP()


def _tiny_mlp_tp_plan(depth: int) -> dict:
    """:func:`tiny_mlp`'s linears tensor-parallel as Megatron pairs them: up column-wise, down
    row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(depth):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


BLOCK_DEPTHS = (1, 3)
BLOCK_MIN_REPS = 10
"""repeats of each reference-block step at least: compute_scale multiplies every layer's time
and the DDP and FSDP2 figures are differences of these steps, where the quick sweep's budget
alone gave the deeper block 3 repeats (one quick profile to the next, compute_scale moved by
8%: 1.32 and 1.43 half an hour apart on 2026-12-06)."""


def block_shape(is_gpu: bool) -> tuple[int, int, int, int, str]:
    """(dim, heads, batch, seq, torch dtype name) of the reference block benchmark: compute
    dominates its launch overhead on both kinds of device."""
    return (1024, 16, 8, 1024, "bfloat16") if is_gpu else (128, 4, 4, 64, "float32")


def block_narrow_dim(is_gpu: bool) -> int:
    """The reference block's second width, timed plain at the batch and at one sample: its
    ops are the same as at :func:`block_shape`'s width and its roofline a small fraction, so
    the widths and batches tell ``compute_scale`` from the per-op cost of a transformer's ops
    (``op_overhead_s``) and from what narrow rows cost (``op_row_s``);
    ``benchmarks/block_widths.py`` prints the fit against the block timed at other widths and
    batches."""
    return 256 if is_gpu else 32


def reference_block(depth: int, dim: int, heads: int):
    """A stack of pre-norm transformer blocks (causal SDPA attention, GELU MLP): the op mix of
    the decoder models autopar plans, for ``compute_scale``."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, s, dim))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention()
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return Stack()


def trimmed_mean(times: list[float], cut: float = 0.05) -> float:
    """The mean of ``times`` less the ``cut`` smallest and largest shares. A collective's time
    is the statistic of a sum (a step makes many calls), and on gloo it is bimodal: the same
    all-reduce of 128 KB between two CPU processes took ~0.5 ms or ~2.5-3 ms, the mode
    changing from repeat to repeat and run to run (measured on this 2-core VM), so the median
    lands on one mode where the step pays their mixture."""
    ordered = sorted(times)
    k = int(len(ordered) * cut)
    kept = ordered[k : len(ordered) - k] or ordered
    return statistics.fmean(kept)


def group_sizes(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f}"


def _worker_main(out: str, quick: bool) -> int:
    w = _Worker(quick)
    plan = [w.matmul, w.elementwise, w.sdpa, w.overhead, w.block, w.collectives]
    total = (
        2 * len(_sizes(quick, "matmul", w.is_gpu))
        + len(_sizes(quick, "elementwise", w.is_gpu))
        + len(_sizes(quick, "sdpa", w.is_gpu))
        + 1
        + 2 * len(MLP_DEPTHS)
        + (len(MLP_DEPTHS) if w.world > 1 else 0)
        + 2
        + len(MLP_DEPTHS)
        + (len(PP_MICROBATCHES) if w.world >= 2 and w.world % 2 == 0 else 0)
        + len(BLOCK_DEPTHS) * ((4 if w.world > 1 else 1) + 2)
        + sum(
            (len(COLLECTIVES) - (g != 2)) * len(_sizes(quick, "collective", w.is_gpu))
            for g in group_sizes(w.world)
        )
    )
    progress = _Progress(total, enabled=w.rank == 0)
    try:
        for bench in plan:
            bench(progress)
    finally:
        progress.close()
    if w.rank == 0:
        meta = {
            "world_size": w.world,
            "backend": "nccl" if w.is_gpu else "gloo",
            "torch_version": w.torch.__version__,
            "gpu": w.torch.cuda.get_device_name() if w.is_gpu else None,
            "threads": w.torch.get_num_threads(),
        }
        Path(out).write_text(json.dumps({"meta": meta, "samples": w.samples}))
    w.finish()
    return 0
