"""The launchers emitted beside ``train.py``: ``launch.sh`` (torchrun, one node or several) and
``launch.slurm`` (sbatch: one torchrun per node through ``srun``).

Both pass every argument through to ``train.py``. On several nodes each node's torchrun joins a
c10d rendezvous (``--rdzv-backend c10d``) at an endpoint and under a job id that every node is given
alike; the rendezvous store is not shared with the workers across restarts
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so every restart of the group gets a fresh store and no
node can read a dead attempt's keys, whatever restart count its own torchrun has reached.

torchrun restarts the group after any failed worker. A user error is not worth retrying: the
ranks write it to ``AUTOPAR_ERROR_FILE`` (a temporary file ``launch.sh`` makes on each node)
and end cleanly on every node (autopar_runtime.user_error_exit_code), so no torchrun restarts;
``launch.sh`` then exits 2. It runs torchrun in the background and passes a signal on to it.
"""

from __future__ import annotations

from autopar.planner.plan import Plan

# torchrun's default c10d rendezvous port; users override it with RDZV_ENDPOINT.
RDZV_PORT = 29400


def nodes_of(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) to launch: a plan smaller than one node uses one node."""
    world, per_node = plan.world_size, plan.cluster.devices_per_node
    if world <= per_node:
        return 1, world
    assert world % per_node == 0, f"world {world} is not whole nodes of {per_node}"
    return world // per_node, per_node


def launch_command(plan: Plan) -> str:
    """The command line that starts the plan on one node (shown in ``train.py``'s docstring)."""
    nodes, per_node = nodes_of(plan)
    if plan.world_size == 1:
        return "python train.py"
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {per_node} train.py"
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        '--rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" train.py'
    )


def launch_files(plan: Plan) -> dict[str, str]:
    """``launch.sh`` and ``launch.slurm`` for ``plan``: file name -> content."""
    return {"launch.sh": _launch_sh(plan), "launch.slurm": _launch_slurm(plan)}


_RESTARTS = [
    "# A rank that crashes (a traceback, killed, its node lost) restarts the group, up to",
    "# MAX_RESTARTS times (default 3 with --checkpoint-dir: training resumes from the latest",
    "# checkpoint; 0 without). A user error is never retried: the ranks record it in",
    "# AUTOPAR_ERROR_FILE and stop cleanly on every node, and this script exits 2.",
    "restarts=0",
    'for arg in "$@"; do',
    '  case "$arg" in --checkpoint-dir | --checkpoint-dir=*) restarts=3 ;; esac',
    "done",
    'AUTOPAR_ERROR_FILE=$(mktemp "${TMPDIR:-/tmp}/autopar-error.XXXXXX")',
    "export AUTOPAR_ERROR_FILE",
    "trap 'rm -f \"$AUTOPAR_ERROR_FILE\"' EXIT",
]

# torchrun in the background, so that a signal to this script reaches it (as `exec` would).
_WAIT = [
    "pid=$!",
    "trap 'kill -TERM \"$pid\" 2>/dev/null' INT TERM HUP",
    "rc=0",
    'wait "$pid" || rc=$?',
    'while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done',
    'if [ -s "$AUTOPAR_ERROR_FILE" ]; then exit 2; fi  # a user error: its line is printed',
    'exit "$rc"',
]


def _job_id(plan: Plan) -> str:
    return f"autopar-{plan.mesh.short().replace(',', '-').replace('=', '')}"


def _launch_sh(plan: Plan) -> str:
    nodes, per_node = nodes_of(plan)
    lines = [
        "#!/usr/bin/env bash",
        f"# Train with the autopar plan in plan.json: {plan.mesh.short()} on "
        f"{plan.world_size} rank(s) ({nodes} node(s) x {per_node}).",
        "# Arguments go to train.py: --steps, --seed, --verify, ... (see train.py --help).",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
    ]
    if plan.world_size == 1:
        return "\n".join([*lines, 'exec python train.py "$@"']) + "\n"
    lines += _RESTARTS
    if nodes == 1:
        lines.append(
            'torchrun --max-restarts "${MAX_RESTARTS:-$restarts}" --standalone '
            f'--nproc-per-node {per_node} train.py "$@" &'
        )
        return "\n".join([*lines, *_WAIT]) + "\n"
    lines += [
        f"# Run this script on each of the {nodes} nodes, with the same arguments and:",
        "#   RDZV_ENDPOINT  host:port of the rendezvous, on the first node (required; MASTER_ADDR",
        f"#                  and MASTER_PORT work too, the port defaulting to {RDZV_PORT})",
        f"#   RDZV_ID        a job id, the same on every node (default {_job_id(plan)})",
        "#   LOCAL_ADDR     this node's address as the others reach it (default: its hostname)",
        "#   RDZV_IS_HOST   1 on the node that hosts the rendezvous, 0 elsewhere (default: the",
        "#                  node whose hostname is the endpoint's host)",
        "#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  the network interface, where several exist",
        'if [ -z "${RDZV_ENDPOINT:-}" ]; then',
        '  : "${MASTER_ADDR:?set RDZV_ENDPOINT (host:port of the first node) or MASTER_ADDR}"',
        f'  RDZV_ENDPOINT="$MASTER_ADDR:${{MASTER_PORT:-{RDZV_PORT}}}"',
        "fi",
        "extra=()",
        'if [ -n "${LOCAL_ADDR:-}" ]; then extra+=(--local-addr "$LOCAL_ADDR"); fi',
        'if [ -n "${RDZV_IS_HOST:-}" ]; then extra+=(--rdzv-conf "is_host=$RDZV_IS_HOST"); fi',
        "# A fresh rendezvous store for every restart: nodes agree on it whatever their counts.",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d \\",
        f'  --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${{RDZV_ID:-{_job_id(plan)}}}" \\',
        '  --max-restarts "${MAX_RESTARTS:-$restarts}" "${extra[@]}" train.py "$@" &',
        *_WAIT,
    ]
    return "\n".join(lines) + "\n"


def _launch_slurm(plan: Plan) -> str:
    nodes, per_node = nodes_of(plan)
    gpu = plan.cluster.device.kind != "cpu"
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={_job_id(plan)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpu else []),
        "#SBATCH --exclusive",
        f"# The autopar plan in plan.json: {plan.mesh.short()} on {plan.world_size} rank(s), "
        f"{nodes} node(s) x {per_node}.",
        "# Submit from this directory: `sbatch launch.slurm --steps 1000 --checkpoint-dir ckpt`",
        "# (arguments go to train.py). srun starts launch.sh once per node, so one torchrun per",
        "# node, all meeting at a rendezvous on the first node under this job's id.",
        "set -euo pipefail",
        'cd "${AUTOPAR_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")}}"',
    ]
    if nodes > 1:
        lines += [
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'export RDZV_ENDPOINT="${{RDZV_ENDPOINT:-$head:{RDZV_PORT}}}"',
            'export RDZV_ID="${RDZV_ID:-autopar-$SLURM_JOB_ID}"',
        ]
    lines.append(
        f'srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash launch.sh "$@"'
    )
    return "\n".join(lines) + "\n"
