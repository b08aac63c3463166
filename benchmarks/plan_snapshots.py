"""Plan JSON of every example and benchmark case, saved or compared: a refactor changes no plan.

    python benchmarks/plan_snapshots.py --save DIR      # write DIR/<case>.json
    python benchmarks/plan_snapshots.py --compare DIR   # exit 1 on any plan that differs
    python benchmarks/plan_snapshots.py --list          # the case names
    [--cases a,b] [-j N]

Cases: the README's example commands (examples/gpt.py, examples/mlp.py, examples/hf/*), option
variants (pinned mesh, schedule, microbatches, checkpointing, SGD), the models of
benchmarks/planning_time.py and the pinned runs of benchmarks/published_runs.py. Each case runs
in a fresh process (the GPT example reads its shape from the environment). Wall-clock fields
(``planning_time_s``) are dropped; everything else must match exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")

WALL_CLOCK = ("planning_time_s",)
# fields added since a snapshot may have been saved: absent in the snapshot, they are not a
# difference (the cpu device's host_cpus: the core count the search once read from os)
NEW_FIELDS = (".cluster.device.host_cpus", ".cluster.groups", ".mixed_cluster")


def _gpt_env(layers: int, dim: int, heads: int, vocab: int, seq: int) -> dict[str, str]:
    return {"GPT_LAYERS": str(layers), "GPT_DIM": str(dim), "GPT_HEADS": str(heads),
            "GPT_VOCAB": str(vocab), "GPT_MAX_SEQ": str(seq)}  # fmt: skip


def _cases() -> dict[str, dict]:
    """name -> {spec, cluster, env, kwargs of plan_model_file}."""
    c: dict[str, dict] = {}

    def add(name, spec, cluster, env=None, **kw):
        c[name] = {"spec": spec, "cluster": cluster, "env": env or {}, "kw": kw}

    # README and examples
    add("gpt-cpu4", GPT, "cpu:4", global_batch=8, seq_len=64)
    add("gpt-cpu2-fsdp2", GPT, "cpu:2", global_batch=8, seq_len=64, mesh={"fsdp": 2})
    add("gpt-cpu2-pp2", GPT, "cpu:2", global_batch=8, seq_len=64, mesh={"pp": 2})
    add("gpt-cpu4-pp2-gpipe", GPT, "cpu:4", global_batch=8, seq_len=64, mesh={"pp": 2},
        schedule="gpipe", microbatches=4)  # fmt: skip
    add("gpt-cpu4-full-ckpt", GPT, "cpu:4", global_batch=8, seq_len=64, checkpoint="full")
    add("gpt-cpu4-sgd", GPT, "cpu:4", global_batch=8, seq_len=64, optimizer="sgd")
    # GPT_MAX_SEQ: the position table must hold seq_len (plan refuses a longer sequence)
    add("gpt-8x8xH100", GPT, "8x8xH100", env={"GPT_MAX_SEQ": "2048"}, global_batch=64,
        seq_len=2048, dtype="bf16")  # fmt: skip
    add("gpt-8xH100-tp2", GPT, "8xH100", env={"GPT_MAX_SEQ": "512"}, global_batch=16,
        seq_len=512, mesh={"tp": 2})  # fmt: skip
    add("gpt-8xH100-mb", GPT, "8xH100", env={"GPT_MAX_SEQ": "512"}, global_batch=16,
        seq_len=512, mesh={"pp": 2}, microbatches=8)  # fmt: skip
    add("gpt1b-2x8xA100", GPT, "2x8xA100-80GB", env=_gpt_env(24, 2048, 16, 50257, 2048),
        global_batch=64, seq_len=2048, dtype="bf16")  # fmt: skip
    add("gpt1b-4xA100-40", GPT, "4xA100-40GB", env=_gpt_env(24, 2048, 16, 50257, 2048),
        global_batch=32, seq_len=2048)  # fmt: skip
    add("mlp-cpu4", MLP, "cpu:4", global_batch=32)
    add("mlp-cpu2-tp2", MLP, "cpu:2", global_batch=32, mesh={"tp": 2})
    add("mlp-big-8xH100", MLP, "8xH100", env={"MLP_WIDTH": "8192", "MLP_BLOCKS": "16"},
        global_batch=256)  # fmt: skip
    add("hf-tiny-llama-pp2", "hf:tiny-llama", "cpu:2", global_batch=4, seq_len=16, mesh={"pp": 2})
    add("hf-tiny-llama-cpu4", "hf:tiny-llama", "cpu:4", global_batch=8, seq_len=16)
    add("hf-tiny-gpt2", "hf:tiny-gpt2", "cpu:2", global_batch=4, seq_len=16)
    add("hf-tiny-bert", "hf:tiny-bert", "cpu:2", global_batch=4, seq_len=16)
    add("hf-gpt2-8xH100", "hf:gpt2", "8xH100", global_batch=64, seq_len=1024, dtype="bf16")
    add("hf-bert-base-4xA100", "hf:bert-base", "4xA100-80GB", global_batch=64, seq_len=512)
    add("hf-llama3-8b-8xH100", "hf:llama3-8b", "8xH100", global_batch=32, seq_len=4096,
        dtype="bf16")  # fmt: skip
    add("hf-llama3-70b", "hf:llama3-70b", "8x8xH100", global_batch=64, seq_len=2048,
        dtype="bf16")  # fmt: skip
    # benchmarks/planning_time.py
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planning_time
    import published_runs

    for name, (layers, dim, heads, vocab, cluster, gb, seq) in planning_time.CASES.items():
        if isinstance(layers, str):
            add(f"time-{name}", layers, cluster, global_batch=gb, seq_len=seq, dtype="bf16")
        else:
            add(f"time-{name}", GPT, cluster, env=_gpt_env(layers, dim, heads, vocab, seq),
                global_batch=gb, seq_len=seq, dtype="bf16")  # fmt: skip
    # benchmarks/published_runs.py
    for name, run in published_runs.RUNS.items():
        kw = dict(global_batch=run.global_batch, seq_len=run.seq_len, dtype="bf16",
                  mesh=run.mesh, checkpoint=run.checkpoint)  # fmt: skip
        if run.model.startswith("gpt:"):
            d = published_runs._shape(run)
            env = _gpt_env(d["layers"], d["hidden"], d["heads"], d["vocab"], run.seq_len)
            add(f"published-{name}", GPT, run.cluster, env=env, **kw)
        elif run.model.startswith("tt:"):
            env = published_runs.tt_env(run)
            add(f"published-{name}", str(published_runs.TT_MODEL), run.cluster, env=env, **kw)
        else:
            add(f"published-{name}", run.model, run.cluster, **kw)
    return c


CHILD = """
import json, sys
from pathlib import Path
import autopar.codegen, autopar.cost_model, autopar.ir, autopar.planner
from autopar.api import plan_model_file
from autopar.model_file import load_model_file
root = Path(sys.argv[2]).resolve()
for module in (autopar, autopar.codegen, autopar.cost_model, autopar.ir, autopar.planner):
    where = Path(module.__file__).resolve()
    if root not in where.parents:
        sys.exit(f"plan_snapshots: {module.__name__} is imported from {where.parent}, not from "
                 f"{root}: an editable install of another checkout; install this one "
                 "(pip install -e .) in its own venv")
case = json.loads(sys.argv[1])
plan = plan_model_file(load_model_file(case["spec"]), case["cluster"], **case["kw"])
print(plan.to_json())
"""


def plan_json(case: dict) -> dict:
    """The plan of one case, wall-clock fields dropped."""
    env = dict(os.environ) | case["env"]
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case), str(ROOT)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    data = json.loads(proc.stdout)
    for key in WALL_CLOCK:
        data.pop(key, None)
    return data


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a and f"{path}.{k}" in NEW_FIELDS:
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {'missing' if k not in a else a[k]!r} -> "
                           f"{'missing' if k not in b else b[k]!r}")  # fmt: skip
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--compare", type=Path)
    g.add_argument("--list", action="store_true")
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    p.add_argument("-j", type=int, default=1, help="cases run at once")
    args = p.parse_args()
    cases = _cases()
    if args.list:
        print("\n".join(cases))
        return 0
    names = args.cases.split(",") if args.cases else list(cases)
    with ThreadPoolExecutor(args.j) as pool:
        results = dict(zip(names, pool.map(lambda n: plan_json(cases[n]), names)))
    bad = 0
    for name, data in results.items():
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True))
            print(f"{name:<28} {'ERROR ' + str(data['error']) if 'error' in data else 'saved'}")
            continue
        if "error" in data:
            bad += 1
            print(f"{name:<28} ERROR {data['error']}")
            continue
        ref = json.loads((args.compare / f"{name}.json").read_text())
        diffs = _diff(ref, data)
        bad += bool(diffs)
        print(f"{name:<28} {'same' if not diffs else 'DIFFERS'}")
        for d in diffs[:12]:
            print(f"    {d}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
