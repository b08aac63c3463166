"""Several nodes, for real: two hosts made of Linux network namespaces joined by a veth pair, one
``launch.sh`` (so one torchrun with c10d rendezvous) per host, gloo across the hosts.

The namespaces share this machine's hostname, so each host's torchrun is given its own address
(``LOCAL_ADDR``), the first host hosts the rendezvous (``RDZV_IS_HOST=1``), and gloo is told its
interface (``GLOO_SOCKET_IFNAME``): the knobs ``launch.sh`` documents for clusters whose nodes
have several interfaces. The addresses exist only inside the namespaces this test makes.
``launch.slurm`` runs through stand-ins for ``srun`` and ``scontrol`` that start its per-node
command in each namespace, as srun would on each node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from _netns import host_env, two_hosts
from _plans import BIN

from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"

pytestmark = [pytest.mark.dist]

_SUBNET = "10.213.7"


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces joined by a veth pair: [(namespace, interface, address)]."""
    yield from two_hosts("ap", _SUBNET)


def _write_two_nodes(path: Path) -> None:
    """A cluster file of 2 cpu nodes x 2 ranks (links: gloo on one host, the veth between)."""
    gloo = {"name": "gloo", "bandwidth_bytes_per_s": 2e9, "latency_s": 4e-4}
    veth = {"name": "veth", "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}
    spec = {"device": "cpu", "num_nodes": 2, "devices_per_node": 2}
    path.write_text(json.dumps({**spec, "intra_node": gloo, "inter_node": veth}))


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> Path:
    """An FSDP x TP plan for 2 nodes x 2 ranks."""
    where = tmp_path_factory.mktemp("multinode")
    cluster = where / "two_nodes.json"
    _write_two_nodes(cluster)
    out = where / "out"
    argv = [str(GPT), "--cluster", str(cluster), "--global-batch", "8", "--seq-len", "32"]
    assert main([*argv, "--mesh", "fsdp=2,tp=2", "--out", str(out), "-q"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["mesh"]["fsdp"] == 2 and plan["mesh"]["tp"] == 2
    return out


def _env(host, rank: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    return host_env(host, rank, _SUBNET, f"test-{os.getpid()}", extra or {})


def _start(hosts, commands: list[list[str]], extra=None, timeout=240) -> list[tuple[int, str]]:
    """Start one command per host at once; return each host's (rc, output)."""
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", host[0], *command],
            env=_env(host, i, extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, (host, command) in enumerate(zip(hosts, commands))
    ]
    results = []
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, text))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def _run_nodes(hosts, command: list[str], extra=None) -> list[str]:
    """``command`` on both hosts at once; each host's output (each must exit 0)."""
    results = _start(hosts, [command] * len(hosts), extra)
    for rc, text in results:
        assert rc == 0, text[-4000:]
    return [text for _, text in results]


def _losses(text: str) -> list[float]:
    lines = [json.loads(x) for x in text.splitlines() if x.startswith('{"step"')]
    return [round(x["loss"], 6) for x in sorted(lines, key=lambda x: x["step"])]


# covered by test_slurm_script_starts_one_torchrun_per_node: the same plan on both hosts, verify ok
@pytest.mark.slow
def test_two_nodes_verify(hosts, emitted):
    first, second = _run_nodes(
        hosts,
        ["bash", str(emitted / "launch.sh"), "--steps", "3", "--verify", "--optimizer", "sgd"],
    )
    assert "verify: ok" in first, first[-3000:]
    assert len(_losses(first)) == 3


@pytest.mark.slow
def test_killed_node_restarts_both_hosts_and_resumes(hosts, emitted, tmp_path):
    """A worker on the second host dies after step 2: torchrun restarts the group on both hosts,
    the run resumes from the step-2 checkpoint and logs the losses of an uninterrupted run."""
    launch = ["bash", str(emitted / "launch.sh"), "--steps", "4", "--optimizer", "sgd"]
    launch += ["--checkpoint-every", "1"]
    whole = _run_nodes(hosts, [*launch, "--checkpoint-dir", str(tmp_path / "whole")])[0]
    marker = tmp_path / "killed"
    kill = {
        "AUTOPAR_TEST_KILL_AT_STEP": "2",
        "AUTOPAR_TEST_KILL_RANK": "3",
        "AUTOPAR_TEST_KILL_MARKER": str(marker),
    }
    outputs = _run_nodes(
        hosts, [*launch, "--checkpoint-dir", str(tmp_path / "killed_run")], extra=kill
    )
    assert marker.exists(), "the kill hook never fired"
    both = "\n".join(outputs)
    assert "resumed from step 2" in both, both[-4000:]
    expected = _losses(whole)
    assert len(expected) == 4
    # rank 0 logs steps 1-2 before the kill and 3-4 after the restart (and maybe 1-2 again
    # nowhere: it resumes); the last value logged for each step must match the whole run.
    resumed = {}
    for line in both.splitlines():
        if line.startswith('{"step"'):
            record = json.loads(line)
            resumed[record["step"]] = round(record["loss"], 6)
    assert [resumed[s] for s in (1, 2, 3, 4)] == pytest.approx(expected, abs=1e-5)


def test_slurm_script_starts_one_torchrun_per_node(hosts, emitted, tmp_path):
    """``launch.slurm`` under stand-ins: scontrol names the first host by its address; srun
    runs the command once per host (in its namespace, with its interface), as on two nodes."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text(f"#!/bin/sh\necho {_SUBNET}.1\necho {_SUBNET}.2\n")
    lines = ["#!/usr/bin/env bash", "set -euo pipefail", 'while [[ "$1" == --* ]]; do shift; done']
    for i, (ns, dev, addr) in enumerate(hosts):
        lines.append(
            f"LOCAL_ADDR={addr} RDZV_IS_HOST={int(i == 0)} GLOO_SOCKET_IFNAME={dev} "
            f'ip netns exec {ns} "$@" > {tmp_path}/node{i}.log 2>&1 & pids+=($!)'
        )
    lines += ['for p in "${pids[@]}"; do wait "$p"; done']
    (shims / "srun").write_text("\n".join(lines) + "\n")
    for shim in ("scontrol", "srun"):
        (shims / shim).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "DIST_TIMEOUT_S": "60",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": str(os.getpid()),
        "SLURM_SUBMIT_DIR": str(emitted),
    }
    script = emitted / "launch.slurm"
    header = script.read_text()
    assert "#SBATCH --nodes=2" in header and "srun" in header
    proc = subprocess.run(
        ["bash", str(script), "--steps", "2", "--verify", "--optimizer", "sgd"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    # a missing node log (srun's stand-in never ran) must not hide launch.slurm's own stderr
    logs = [
        path.read_text() if path.exists() else f"({path.name} was not written)"
        for path in (tmp_path / f"node{i}.log" for i in range(2))
    ]
    assert proc.returncode == 0, textwrap.shorten(proc.stderr + "\n".join(logs), 4000)
    assert all(not x.startswith("(node") for x in logs), proc.stderr[-3000:]
    assert "verify: ok" in logs[0], logs[0][-3000:]


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_node_with_another_plan_stops_every_node(hosts, emitted, tmp_path):
    """The second node runs a plan with another global batch: both nodes stop at once with one
    error line each, before any collective (not a hang until the timeout), and, a user error,
    without torchrun's restarts (MAX_RESTARTS=3): launch.sh exits 2 on both."""
    other = tmp_path / "other"
    argv = [str(GPT), "--cluster", str(emitted.parent / "two_nodes.json"), "--seq-len", "32"]
    assert (
        main([*argv, "--global-batch", "16", "--mesh", "fsdp=2,tp=2", "--out", str(other), "-q"])
        == 0
    )
    launch = ["--steps", "2", "--optimizer", "sgd"]
    results = _start(
        hosts,
        [
            ["bash", str(emitted / "launch.sh"), *launch],
            ["bash", str(other / "launch.sh"), *launch],
        ],
        extra={"MAX_RESTARTS": "3"},
        timeout=120,
    )
    for rc, text in results:
        assert rc == 2, text[-3000:]
        errors = _errors(text)
        assert len(errors) == 1 and "other files" in errors[0], text[-3000:]


@pytest.mark.slow
def test_a_node_without_the_model_file_stops_every_node(hosts, tmp_path):
    """The model file is missing on the second node (hidden there by an empty tmpfs): that node
    says so, and the first node stops with the same line instead of waiting for it."""
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    shutil.copy(GPT, model_dir / "gpt.py")
    cluster = tmp_path / "two_nodes.json"
    _write_two_nodes(cluster)
    out = tmp_path / "out"
    argv = [str(model_dir / "gpt.py"), "--cluster", str(cluster), "--global-batch", "8"]
    assert main([*argv, "--seq-len", "32", "--mesh", "dp=4", "--out", str(out), "-q"]) == 0
    launch = ["bash", str(out / "launch.sh"), "--steps", "2"]
    hidden = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none {model_dir} && exec "$@"', "sh"]
    results = _start(hosts, [launch, [*hidden, *launch]], extra={"MAX_RESTARTS": "3"}, timeout=120)
    for rc, text in results:
        assert rc == 2, text[-3000:]
        errors = _errors(text)
        assert len(errors) == 1 and "is not on this node" in errors[0], text[-3000:]
        assert "node 1" in errors[0], errors


@pytest.mark.slow
@pytest.mark.bad_input
def test_slurm_node_that_never_arrives_is_named_after_rdzv_timeout(hosts, emitted, tmp_path):
    """srun's stand-in starts the first node only: after RDZV_TIMEOUT_S its launch.sh says the
    rendezvous did not complete, names the node that arrived and, from the job's node list,
    the one that did not; exit 2 (issue 25), where torchrun alone waited 600 s, then a
    traceback."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text(f"#!/bin/sh\necho {_SUBNET}.1\necho {_SUBNET}.2\n")
    ns, dev, addr = hosts[0]
    (shims / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        f'LOCAL_ADDR={addr} RDZV_IS_HOST=1 GLOO_SOCKET_IFNAME={dev} exec ip netns exec {ns} "$@"\n'
    )
    for shim in ("scontrol", "srun"):
        (shims / shim).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "RDZV_TIMEOUT_S": "4",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": str(os.getpid()),
        "SLURM_SUBMIT_DIR": str(emitted),
    }
    proc = subprocess.run(
        ["bash", str(emitted / "launch.slurm"), "--steps", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"1 of 2 nodes arrived ({addr}), 1 did not ({_SUBNET}.2)" in errors[0], errors
