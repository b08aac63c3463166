"""What running attention on DTensors costs against running it on local heads, side by side.

    python benchmarks/dtensor_blocks.py [--steps 30] [--rounds 2] [--dim 256] [--seq-len 128]

Two GPTs that differ only in how their attention spells its sizes (``tests/models/heads.py``
blocks, separate q/k/v, SDPA): ``local`` views with ``self.n_head`` and ``self.head_dim`` (the
plan divides the head count: Megatron pairs on local heads), ``dtensor`` with nanoGPT's
``C // self.n_head`` and ``view(B, T, C)`` (Megatron pairs on DTensors of full shape:
``colwise_dtensor``). Each is planned at a pinned tp=2 on cpu:2 (same styles elsewhere), emitted,
and run under torchrun for ``--steps`` steps, alternating between the two ``--rounds`` times
(the machine is noisy: the ratio is taken round by round). It prints per variant the predicted
step time and the median measured ``step_time_s`` of the steps after the first two, and the
measured ratio dtensor / local: DTensor's per-op dispatch, which the cost model does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.api import plan_model_file  # noqa: E402
from autopar.model_file import load_model_file  # noqa: E402

MODEL = '''
import sys
import torch.nn.functional as F
sys.path.insert(0, {models!r})
import heads

DIM, HEADS, LAYERS, SEQ = {dim}, {heads}, {layers}, {seq}


class LocalAttention(heads.NanoGPTAttention):
    """nanoGPT's attention with its sizes from the head-count attributes (local heads)."""

    def forward(self, x):
        B, T, _ = x.size()
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim))


heads.ATTENTION["local"] = lambda dim, n, seq: LocalAttention(dim, n, seq)


def build_local():
    return heads.GPT("local", DIM, HEADS, LAYERS, SEQ)


def build_dtensor():
    return heads.GPT("nanogpt", DIM, HEADS, LAYERS, SEQ)


make_batch = heads.make_batch
'''


def run(out: Path, steps: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           str(out / "train.py"), "--steps", str(steps), "--optimizer", "sgd"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    rows = [json.loads(x) for x in text.splitlines() if x.startswith('{"step"')]
    return [r["step_time_s"] for r in rows[2:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.py"
        model.write_text(MODEL.format(models=str(ROOT / "tests" / "models"), dim=args.dim,
                                      heads=args.heads, layers=args.layers, seq=args.seq_len))  # fmt: skip
        outs, predicted = {}, {}
        for name in ("local", "dtensor"):
            plan = plan_model_file(
                load_model_file(f"{model}:build_{name}"), "cpu:2", global_batch=args.global_batch,
                seq_len=args.seq_len, mesh={"tp": 2}, optimizer="sgd",
            )  # fmt: skip
            styles = sorted({s for f, s in plan.tensor_parallel.items() if ".attn." in f})
            print(f"{name:8s} attention styles: {', '.join(styles)}", flush=True)
            outs[name] = plan.emit(Path(tmp) / name)
            predicted[name] = plan.predicted.step_time_s
        measured: dict[str, list[float]] = {"local": [], "dtensor": []}
        ratios = []
        for r in range(args.rounds):
            medians = {}
            for name in ("local", "dtensor"):
                times = run(outs[name], args.steps)
                measured[name] += times
                medians[name] = statistics.median(times)
            ratios.append(medians["dtensor"] / medians["local"])
            print(f"round {r + 1}: local {medians['local'] * 1e3:.2f} ms, dtensor "
                  f"{medians['dtensor'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
    for name in ("local", "dtensor"):
        print(f"{name:8s} predicted {predicted[name] * 1e3:.2f} ms, measured median "
              f"{statistics.median(measured[name]) * 1e3:.2f} ms per step")  # fmt: skip
    print(f"dtensor / local (median of rounds): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
