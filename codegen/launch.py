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

A launch that cannot work is one ``error:`` line and exit 2 before torchrun starts: an unset
rendezvous endpoint, a port that is not 1..65535, a count that is not a count, ``launch.slurm``
outside a SLURM job. The rendezvous is bounded (``RDZV_TIMEOUT_S``, default 600 s): past it with
no rank started on its node, ``launch.sh`` says which nodes arrived
(autopar_runtime.report_rendezvous), ends its torchrun and exits 2; torch's own rendezvous
timeouts are set 120 s longer, so that line comes first. torchrun ends with ``launch.sh``, even
when it is killed (``setpriv --pdeathsig``, util-linux, where present), and the ranks end with
their torchrun (autopar_runtime.tie_to_launcher): no orphan keeps training or saving.

Elastic plans (``plan --elastic MIN:MAX``): ``launch.sh`` starts torchrun's elastic agent on
each node with ``--nnodes MIN:MAX`` and the c10d rendezvous (on one node too: other nodes may
join). The agent restarts the group when a node is lost (a failure: MAX_RESTARTS counts it) or
when one waits to join (not counted); a rendezvous closes RDZV_LAST_CALL_S (default 30 s) after
MIN nodes arrived. Each worker runs the program planned for the node count it finds
(autopar_runtime.take_elastic_plan) and resumes from the latest complete checkpoint.
``launch.slurm`` asks for ``--nodes=MIN-MAX`` and starts ``launch.sh`` on the nodes it got.
"""

from __future__ import annotations

from autopar.planner.plan import Plan

# torchrun's default c10d rendezvous port; users override it with RDZV_ENDPOINT.
RDZV_PORT = 29400
# How long launch.sh waits for every node at the rendezvous (RDZV_TIMEOUT_S overrides it), and
# how much longer torch's own rendezvous timeouts are, so that launch.sh's report comes first.
RDZV_TIMEOUT_S = 600
TORCH_RDZV_MARGIN_S = 120
# How long an elastic rendezvous waits, once MIN nodes arrived, for more (RDZV_LAST_CALL_S).
RDZV_LAST_CALL_S = 30

Nodes = tuple[int, int] | None
"""An elastic plan set's (MIN, MAX) node counts; None: the plan's own node count."""


def nodes_of(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) to launch: a plan smaller than one node uses one node."""
    world, per_node = plan.world_size, plan.cluster.devices_per_node
    if world <= per_node:
        return 1, world
    assert world % per_node == 0, f"world {world} is not whole nodes of {per_node}"
    return world // per_node, per_node


def _nnodes(plan: Plan, elastic: Nodes) -> str:
    """torchrun's --nnodes: the plan's node count, or MIN:MAX."""
    return f"{elastic[0]}:{elastic[1]}" if elastic else str(nodes_of(plan)[0])


def launch_command(plan: Plan, elastic: Nodes = None) -> str:
    """The command line that starts the plan on one node (shown in ``train.py``'s docstring)."""
    nodes, per_node = nodes_of(plan)
    if elastic:
        return (
            f"torchrun --nnodes {_nnodes(plan, elastic)} --nproc-per-node {per_node} "
            '--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" train.py'
            "  (on each node: bash launch.sh)"
        )
    if plan.world_size == 1:
        return "python train.py"
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {per_node} train.py"
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        '--rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" train.py'
    )


def run_hint(plan: Plan, out: str, elastic: Nodes = None) -> str:
    """What ``plan --out`` prints last: how to run the program written to ``out``. Through
    ``launch.sh``, whose user errors are one line and exit 2 (under torchrun alone a rank's
    error line is followed by torchrun's own report and exit 1), on each node where the plan
    spans several."""
    launch = f"bash {out.rstrip('/')}/launch.sh"
    if elastic:
        return (
            f"run it on each of {elastic[0]}..{elastic[1]} nodes:  RDZV_ENDPOINT=HOST:PORT "
            f"{launch} --steps 10 --checkpoint-dir CKPT"
        )
    nodes = nodes_of(plan)[0]
    if nodes > 1:
        return f"run it on each of the {nodes} nodes:  RDZV_ENDPOINT=HOST:PORT {launch} --steps 10"
    return f"run it:  {launch} --steps 10 --verify"


def launch_files(plan: Plan, elastic: Nodes = None) -> dict[str, str]:
    """``launch.sh`` and ``launch.slurm`` for ``plan`` (``elastic``: (MIN, MAX) nodes, ``plan``
    the largest's): file name -> content."""
    return {"launch.sh": _launch_sh(plan, elastic), "launch.slurm": _launch_slurm(plan, elastic)}


_RESTARTS = [
    "# A launch that cannot work: one line, exit 2 (as train.py's own checks).",
    'fail() { echo "error: $*" >&2; exit 2; }',
    "# A rank that crashes (a traceback, killed, its node lost) restarts the group, up to",
    "# MAX_RESTARTS times (default 3 with --checkpoint-dir: training resumes from the latest",
    "# checkpoint; 0 without). A user error is never retried: the ranks record it in",
    "# AUTOPAR_ERROR_FILE and stop cleanly on every node, and this script exits 2.",
    "restarts=0",
    'for arg in "$@"; do',
    '  case "$arg" in --checkpoint-dir | --checkpoint-dir=*) restarts=3 ;; esac',
    "done",
    'if ! [[ "${MAX_RESTARTS:-0}" =~ ^[0-9]{1,6}$ ]]; then',
    '  fail "MAX_RESTARTS=$MAX_RESTARTS is not a count: use an integer >= 0 (0: no restart)"',
    "fi",
    'AUTOPAR_ERROR_FILE=$(mktemp "${TMPDIR:-/tmp}/autopar-error.XXXXXX")',
    "export AUTOPAR_ERROR_FILE",
    "trap 'rm -f \"$AUTOPAR_ERROR_FILE\"' EXIT",
    "# torchrun ends when this script ends, even by SIGKILL (setpriv --pdeathsig, util-linux),",
    "# and its ranks end with torchrun (autopar_runtime.tie_to_launcher): no orphan trains on.",
    "tie=()",
    "if setpriv --help 2>&1 | grep -- --pdeathsig >/dev/null; then tie=(setpriv --pdeathsig TERM); fi",
]

# torchrun in the background, so that a signal to this script reaches it (as `exec` would).
_WAIT = [
    "trap 'kill -TERM \"$pid\" 2>/dev/null' INT TERM HUP",
    "rc=0",
    "# (wait's stderr: bash's own note of a job killed by a signal, a second line)",
    'wait "$pid" 2>/dev/null || rc=$?',
    'while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" 2>/dev/null || rc=$?; done',
    'if [ -s "$AUTOPAR_ERROR_FILE" ]; then exit 2; fi  # a user error: its line is printed',
    'exit "$rc"',
]


def _endpoint(plan: Plan, elastic: Nodes = None) -> list[str]:
    """launch.sh's checks of the rendezvous settings, before torchrun (bash)."""
    nodes = _nnodes(plan, elastic).replace(":", " to ")
    return [
        'from="RDZV_ENDPOINT=${RDZV_ENDPOINT:-}"',
        'if [ -z "${RDZV_ENDPOINT:-}" ]; then',
        '  if [ -z "${MASTER_ADDR:-}" ]; then',
        f'    fail "RDZV_ENDPOINT and MASTER_ADDR are unset, and this plan runs on {nodes} nodes:" \\',
        '      "set RDZV_ENDPOINT=host:port of the first node (or MASTER_ADDR, and MASTER_PORT," \\',
        f'      "default {RDZV_PORT}) alike on every node"',
        "  fi",
        f'  RDZV_ENDPOINT="$MASTER_ADDR:${{MASTER_PORT:-{RDZV_PORT}}}"',
        f'  from="MASTER_ADDR=$MASTER_ADDR MASTER_PORT=${{MASTER_PORT:-{RDZV_PORT}}}"',
        "fi",
        'case "$RDZV_ENDPOINT" in  # host:port, host, [v6 address]:port or [v6 address]',
        f"  \\[*\\]) rdzv_host=$RDZV_ENDPOINT rdzv_port={RDZV_PORT} ;;",
        "  *:*) rdzv_host=${RDZV_ENDPOINT%:*} rdzv_port=${RDZV_ENDPOINT##*:} ;;",
        f"  *) rdzv_host=$RDZV_ENDPOINT rdzv_port={RDZV_PORT} ;;",
        "esac",
        'if [ -z "$rdzv_host" ]; then fail "$from names no host: use host:port of the first node"; fi',
        'if ! [[ "$rdzv_port" =~ ^[0-9]{1,5}$ ]] || ((10#$rdzv_port < 1 || 10#$rdzv_port > 65535)); then',
        "  fail \"the rendezvous port '$rdzv_port' ($from) is not a port number:\" \\",
        f'    "use an integer 1..65535 (default {RDZV_PORT})"',
        "fi",
        f"rdzv_timeout=${{RDZV_TIMEOUT_S:-{RDZV_TIMEOUT_S}}}",
        'if ! [[ "$rdzv_timeout" =~ ^[0-9]{1,7}$ ]] || ((10#$rdzv_timeout < 1)); then',
        '  fail "RDZV_TIMEOUT_S=$rdzv_timeout is not a number of seconds:" \\',
        f'    "use an integer >= 1 (default {RDZV_TIMEOUT_S})"',
        "fi",
        "rdzv_timeout=$((10#$rdzv_timeout))",
        "# The node that hosts the rendezvous binds its port: another program there would leave",
        "# torchrun with a traceback (or, unsure whether it hosts, waiting on that program).",
        "host_addr=${rdzv_host#[}",
        'if [ "${RDZV_IS_HOST:-}" = 1 ] &&',
        '  timeout 5 bash -c \'exec 3<>"/dev/tcp/$1/$2"\' _ "${host_addr%]}" "$rdzv_port" 2>/dev/null; then',
        '  fail "port $rdzv_port of $rdzv_host, where this node hosts the rendezvous (RDZV_IS_HOST=1),"'
        " \\",
        '    "is held by another program: stop it, or choose a free port ($from)"',
        "fi",
    ]


def _watch_rendezvous(plan: Plan, elastic: Nodes = None) -> list[str]:
    """The bounded rendezvous (bash, run in the background beside torchrun)."""
    nodes = elastic[0] if elastic else nodes_of(plan)[0]
    report = "import sys, autopar_runtime as rt; rt.report_rendezvous(*map(int, sys.argv[1:]))"
    return [
        "# The rendezvous is bounded: with no rank started on this node after RDZV_TIMEOUT_S, say",
        "# which nodes arrived (autopar_runtime.report_rendezvous) and end torchrun (no rank yet).",
        "watch_rendezvous() {",
        "  local end=$((SECONDS + rdzv_timeout)) rc=0",
        "  while ((SECONDS < end)); do",
        "    sleep 1",
        '    if [ -s "$AUTOPAR_STARTED_FILE" ] || [ -s "$AUTOPAR_ERROR_FILE" ]; then return 0; fi',
        '    if ! kill -0 "$pid" 2>/dev/null; then return 0; fi',
        "  done",
        f"  PYTHONPATH=\"$here${{PYTHONPATH:+:$PYTHONPATH}}\" timeout 120 python -c '{report}' "
        f'{nodes} "$rdzv_timeout" || rc=$?',
        '  if [ "$rc" = 0 ]; then return 0; fi  # the rendezvous completed after all',
        '  if [ "$rc" != 2 ]; then  # the report itself failed (timeout, no python): say so here',
        '    echo "error: the rendezvous at $RDZV_ENDPOINT (RDZV_ID $RDZV_ID) did not complete" \\',
        '      "within $rdzv_timeout s (RDZV_TIMEOUT_S): start launch.sh on every node with the" \\',
        '      "same RDZV_ENDPOINT and RDZV_ID" | tee -a "$AUTOPAR_ERROR_FILE" >&2',
        "  fi",
        '  kill -KILL "$pid" 2>/dev/null || true',
        "}",
    ]


def _job_id(plan: Plan) -> str:
    return f"autopar-{plan.mesh.short().replace(',', '-').replace('=', '')}"


def _launch_sh(plan: Plan, elastic: Nodes = None) -> str:
    nodes, per_node = nodes_of(plan)
    what = f"{plan.world_size} rank(s) ({nodes} node(s) x {per_node})"
    if elastic:
        what += f"; elastic: {elastic[0]} to {elastic[1]} nodes, plans/<K>nodes.py for each"
    lines = [
        "#!/usr/bin/env bash",
        f"# Train with the autopar plan in plan.json: {plan.mesh.short()} on {what}.",
        "# Arguments go to train.py: --steps, --seed, --verify, ... (see train.py --help).",
        "set -euo pipefail",
        "# Paths in the arguments are the caller's, as with train.py run directly: this script",
        "# runs the program beside it without changing directory.",
        'here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)  # CDPATH set would echo the folder',
    ]
    if plan.world_size == 1 and not elastic:
        return "\n".join([*lines, 'exec python "$here/train.py" "$@"']) + "\n"
    lines += _RESTARTS
    if nodes == 1 and not elastic:
        lines.append(
            '"${tie[@]}" torchrun --max-restarts "${MAX_RESTARTS:-$restarts}" --standalone '
            f'--nproc-per-node {per_node} "$here/train.py" "$@" &'
        )
        return "\n".join([*lines, "pid=$!", *_WAIT]) + "\n"
    margin = TORCH_RDZV_MARGIN_S
    nnodes = _nnodes(plan, elastic)
    conf = (
        f'conf="join_timeout=$((rdzv_timeout + {margin})),read_timeout=$((rdzv_timeout + {margin}))'
    )
    if elastic:
        conf += f",last_call_timeout=${{RDZV_LAST_CALL_S:-{RDZV_LAST_CALL_S}}}"
    lines += [
        f"# Run this script on each of the {nnodes.replace(':', ' to ')} nodes, with the same arguments and:",
        "#   RDZV_ENDPOINT  host:port of the rendezvous, on the first node (required; MASTER_ADDR",
        f"#                  and MASTER_PORT work too, the port defaulting to {RDZV_PORT})",
        f"#   RDZV_ID        a job id, the same on every node (default {_job_id(plan)})",
        f"#   RDZV_TIMEOUT_S seconds to wait for every node (default {RDZV_TIMEOUT_S}), then say",
        "#                  which nodes arrived and exit 2",
        "#   LOCAL_ADDR     this node's address as the others reach it (default: its hostname)",
        "#   RDZV_IS_HOST   1 on the node that hosts the rendezvous, 0 elsewhere (default: the",
        "#                  node whose hostname is the endpoint's host)",
        "#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  the network interface, where several exist",
        *(
            [
                "#   RDZV_LAST_CALL_S  seconds a rendezvous waits for more nodes once the fewest",
                f"#                  arrived (default {RDZV_LAST_CALL_S})",
            ]
            if elastic
            else []
        ),
        *_endpoint(plan, elastic),
        f'export RDZV_ENDPOINT RDZV_ID="${{RDZV_ID:-{_job_id(plan)}}}"',
        conf + '"',
        'if [ -n "${RDZV_IS_HOST:-}" ]; then conf+=",is_host=$RDZV_IS_HOST"; fi',
        "extra=()",
        'if [ -n "${LOCAL_ADDR:-}" ]; then extra+=(--local-addr "$LOCAL_ADDR"); fi',
        "# A fresh rendezvous store for every restart: nodes agree on it whatever their counts.",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "# The ranks note here that they started (the rendezvous is done).",
        'AUTOPAR_STARTED_FILE=$(mktemp "${TMPDIR:-/tmp}/autopar-started.XXXXXX")',
        "export AUTOPAR_STARTED_FILE",
        'trap \'rm -f "$AUTOPAR_ERROR_FILE" "$AUTOPAR_STARTED_FILE"\' EXIT',
        *_watch_rendezvous(plan, elastic),
        f'"${{tie[@]}}" torchrun --nnodes {nnodes} --nproc-per-node {per_node} --rdzv-backend c10d \\',
        '  --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" --rdzv-conf "$conf" \\',
        '  --max-restarts "${MAX_RESTARTS:-$restarts}" "${extra[@]}" "$here/train.py" "$@" &',
        "pid=$!",
        "watch_rendezvous &",
        *_WAIT,
    ]
    return "\n".join(lines) + "\n"


def _launch_slurm(plan: Plan, elastic: Nodes = None) -> str:
    nodes, per_node = nodes_of(plan)
    gpu = plan.cluster.device.kind != "cpu"
    where = f"on each of the {nodes} nodes (see launch.sh)" if nodes > 1 else "(see launch.sh)"
    sbatch_nodes = f"{elastic[0]}-{elastic[1]}" if elastic else str(nodes)
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={_job_id(plan)}",
        f"#SBATCH --nodes={sbatch_nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpu else []),
        "#SBATCH --exclusive",
        f"# The autopar plan in plan.json: {plan.mesh.short()} on {plan.world_size} rank(s), "
        f"{nodes} node(s) x {per_node}.",
        "# Submit from this directory: `sbatch launch.slurm --steps 1000 --checkpoint-dir ckpt`",
        "# (arguments go to train.py). srun starts launch.sh once per node, so one torchrun per",
        "# node, all meeting at a rendezvous on the first node under this job's id.",
        "set -euo pipefail",
        "# Outside a SLURM job (no srun, no SLURM_JOB_ID): one line, exit 2.",
        "outside=",
        'if ! command -v srun >/dev/null 2>&1; then outside="srun is not on PATH"; fi',
        'if [ -z "${SLURM_JOB_ID:-}" ]; then outside="${outside:-SLURM_JOB_ID is unset}"; fi',
        'if [ -n "$outside" ]; then',
        '  echo "error: launch.slurm runs inside a SLURM job, and here $outside: submit it with" \\',
        '    "\\`sbatch launch.slurm ARGS\\`, or without SLURM run \\`bash launch.sh ARGS\\`" \\',
        f'    "{where}" >&2',
        "  exit 2",
        "fi",
        'cd "${AUTOPAR_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")}}"',
    ]
    if nodes > 1 or elastic:
        lines += [
            "# The job's nodes: the first hosts the rendezvous; the list names any that never",
            "# arrive (autopar_runtime.report_rendezvous).",
            "read -r -a job_nodes <<<\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | tr '\\n' ' ')\"",
            'export AUTOPAR_NODES="${job_nodes[*]}"',
            f'export RDZV_ENDPOINT="${{RDZV_ENDPOINT:-${{job_nodes[0]}}:{RDZV_PORT}}}"',
            'export RDZV_ID="${RDZV_ID:-autopar-$SLURM_JOB_ID}"',
        ]
    srun_nodes = "${SLURM_JOB_NUM_NODES:-${#job_nodes[@]}}" if elastic else str(nodes)
    if elastic:  # an elastic run goes on when a node is lost: srun must not end the others
        lines.append(f'srun --nodes={srun_nodes} --ntasks-per-node=1 bash launch.sh "$@"')
    else:
        lines.append(
            f'srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash launch.sh "$@"'
        )
    return "\n".join(lines) + "\n"
