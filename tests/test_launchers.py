"""What cannot work at launch is one ``error:`` line and exit 2 (issue 25, classes 5 and 6):
mistyped flags of the emitted train.py (checked once, before any collective, and never retried
by launch.sh's torchrun), rendezvous settings that launch.sh cannot use, a rendezvous that never
completes (bounded by RDZV_TIMEOUT_S, then which nodes arrived), launch.slurm outside SLURM;
and a killed launcher takes its ranks with it.

Cheap first: the flags in process (rt.parse_args, rt.check_flags), launch.sh's and launch.slurm's
checks with bash alone (PATH without torchrun: nothing heavier can start), the rendezvous report
against a real store holding a state torch would write. Then one launch.sh run per class: a
mistyped flag under --checkpoint-dir, and launch.sh killed mid-run. Further runs are slow.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from _plans import BIN, GPT, forced_plan, run_bounded
from autopar.codegen import write_outputs
from autopar.codegen.apply import runtime
from autopar.codegen.emit import constants
from autopar.codegen.launch import run_hint
from autopar.cost_model import parse_cluster
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

rt = runtime()  # the emitted autopar_runtime package, imported as train.py imports it

pytestmark = pytest.mark.bad_input

BLOCKS = [f"blocks.{i}" for i in range(4)]
# What a launch may find in the environment; each test states its own.
_LAUNCH_ENV = ("RDZV_", "MASTER_", "SLURM_", "LOCAL_ADDR", "MAX_RESTARTS", "AUTOPAR_", "TORCHELAS")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _one_error(text: str) -> str:
    """The one ``error:`` line of ``text``, which holds no traceback."""
    errors = _errors(text)
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    return errors[0]


def _bare_env(path: str, **env: str) -> dict[str, str]:
    """This environment without any launch setting, with ``path`` as PATH, plus ``env``."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    return {**kept, "PATH": path, **env}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    """The files of a dp=2 plan over 2 cpu nodes of 1 rank (launch.sh for several nodes)."""
    where = tmp_path_factory.mktemp("two_nodes")
    spec = where / "two_nodes.json"
    link = {"name": "gloo", "bandwidth_bytes_per_s": 2e9, "latency_s": 4e-4}
    nodes = {"device": "cpu", "num_nodes": 2, "devices_per_node": 1}
    spec.write_text(json.dumps({**nodes, "intra_node": link, "inter_node": link}))
    plan = forced_plan(GPT, 2, {"dp": 2}, {}, layers=BLOCKS, optimizer="sgd")
    plan = plan.model_copy(update={"cluster": parse_cluster(str(spec))})
    return write_outputs(plan, where / "out")


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The files of a dp=2 plan on one node of 2 cpu ranks."""
    plan = forced_plan(GPT, 2, {"dp": 2}, {}, layers=BLOCKS, optimizer="sgd", lr=0.05)
    return write_outputs(plan, tmp_path_factory.mktemp("one_node") / "out")


# ---- train.py's flags, in process -----------------------------------------------------------
def _flags(argv: list[str], capsys) -> tuple[int | None, str]:
    """(exit code, stderr) of parse_args and check_flags on ``argv``; None: accepted."""
    c = rt.Constants(**constants(forced_plan(GPT, 1, {}, {}, layers=BLOCKS)))
    try:
        rt.check_flags(c, rt.parse_args(c, "train.py", argv))
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return None, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--lr", "-0.001"], "--lr -0.001 must be a finite number >= 0"),
        (["--lr", "nan"], "--lr nan must be"),
        (["--lr", "inf"], "--lr inf must be"),
        (["--weight-decay", "nan"], "--weight-decay nan must be a finite number >= 0"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be"),
        (["--max-grad-norm", "inf"], "--max-grad-norm inf must be a finite number > 0"),
        (["--max-grad-norm", "0"], "--max-grad-norm 0.0 must be"),
        (["--seed", "2**70"], "argument --seed: invalid int value: '2**70'"),
        (["--seed", str(2**70)], f"--seed {2**70} must be in 0 .. 2**32 - 1"),
        (["--seed", str(2**32)], f"--seed {2**32} must be in 0 .. 2**32 - 1"),
        (["--seed", "-1"], "--seed -1 must be in 0 .. 2**32 - 1"),
        (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["--steps", "0"], "--steps (0) and --log-every (1) must be >= 1"),
        (["--warmup-steps", "-1"], "--warmup-steps -1 must be >= 0"),
        (["--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam'"),
        (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_mistyped_flag_is_one_line_and_exit_2(argv, named, capsys) -> None:
    code, err = _flags(argv, capsys)
    assert code == 2, err
    assert _one_error(err).startswith(f"error: {named}"), err
    assert err.count("\n") == 1, err  # argparse's usage lines are not printed


def test_flags_in_range_pass_and_help_exits_0(capsys) -> None:
    """The edges of each range are accepted; --warmup-steps beyond --steps too (a short trial
    of a long run's flags)."""
    edges = ["--lr", "0", "--weight-decay", "0", "--seed", str(2**32 - 1)]
    edges += ["--max-grad-norm", "1e-6", "--steps", "2", "--warmup-steps", "100"]
    assert _flags(edges, capsys) == (None, "")
    code, _ = _flags(["--help"], capsys)
    assert code == 0


@pytest.mark.parametrize("cxx", ["/nonexistent/g++", "no-such-compiler-xyz"])
def test_compile_without_a_cpp_compiler_is_one_line(cxx, monkeypatch, capsys) -> None:
    """Inductor finds its compiler in torch._inductor.config.cpp.cxx (read from CXX when torch
    starts, else g++); one it cannot run stops --compile before any collective."""
    from torch._inductor import config

    with config.patch({"cpp.cxx": (None, cxx)}):
        code, err = _flags(["--compile"], capsys)
        assert code == 2, err
        line = _one_error(err)
        assert line.startswith("error: --compile: inductor builds C++") and cxx in line, line
        # another backend (a test's, tests/harness): no C++, no check
        launch = importlib.import_module("autopar_runtime.launch")
        monkeypatch.setattr(launch, "compile_backend", lambda: "aot_eager")
        assert _flags(["--compile"], capsys) == (None, "")


# ---- launch.sh and launch.slurm: their own checks, bash alone --------------------------------
def _bash(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/bash", script.name, "--steps", "1"],
        cwd=script.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "RDZV_ENDPOINT and MASTER_ADDR are unset"),
        ({"MASTER_ADDR": "node0"}, None),  # the default port: this one passes the checks
        ({"MASTER_ADDR": "node0", "MASTER_PORT": "abc"}, "port 'abc' (MASTER_ADDR=node0"),
        ({"RDZV_ENDPOINT": "node0:70000"}, "port '70000' (RDZV_ENDPOINT=node0:70000)"),
        ({"RDZV_ENDPOINT": "node0:0"}, "port '0'"),
        ({"RDZV_ENDPOINT": "node0:"}, "port ''"),
        ({"RDZV_ENDPOINT": ":29400"}, "RDZV_ENDPOINT=:29400 names no host"),
        ({"RDZV_ENDPOINT": "node0", "RDZV_TIMEOUT_S": "10m"}, "RDZV_TIMEOUT_S=10m is not"),
        ({"RDZV_ENDPOINT": "node0", "RDZV_TIMEOUT_S": "0"}, "RDZV_TIMEOUT_S=0 is not"),
        ({"RDZV_ENDPOINT": "node0", "MAX_RESTARTS": "three"}, "MAX_RESTARTS=three is not"),
    ],
)
def test_launch_settings_that_cannot_work_are_one_line(two_nodes, env, named, tmp_path) -> None:
    """Checked before torchrun starts: PATH holds no torchrun, so a setting that passes ends
    in bash's `torchrun: command not found` (exit 127) and one that fails in one line."""
    proc = _bash(two_nodes / "launch.sh", _bare_env("/usr/bin:/bin", **env))
    if named is None:
        assert proc.returncode == 127 and "torchrun" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    line = _one_error(proc.stderr)
    assert named in line and proc.stderr.count("\n") == 1, proc.stderr


def test_a_held_port_on_the_rendezvous_host_is_one_line(two_nodes) -> None:
    """RDZV_IS_HOST=1 and another program listening on the port: torchrun would end in a
    traceback (it cannot bind); launch.sh says so first."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        env = {"RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_IS_HOST": "1"}
        proc = _bash(two_nodes / "launch.sh", _bare_env("/usr/bin:/bin", **env))
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} of 127.0.0.1" in _one_error(proc.stderr), proc.stderr


def test_plan_out_says_to_run_it_through_launch_sh_on_each_node() -> None:
    """The line ``plan --out`` ends with: launch.sh (a user error: one line, exit 2; torchrun
    alone adds its own report and exits 1), on each node where the plan spans several (not
    one node's torchrun with every rank)."""
    one = forced_plan(GPT, 2, {"dp": 2}, {}, layers=BLOCKS)
    assert run_hint(one, "out/") == "run it:  bash out/launch.sh --steps 10 --verify"
    spanning = one.model_copy(update={"cluster": parse_cluster("2x1xH100")})
    hint = run_hint(spanning, "out")
    assert hint.startswith("run it on each of the 2 nodes:  RDZV_ENDPOINT=HOST:PORT "), hint
    assert "bash out/launch.sh" in hint and "torchrun" not in hint, hint
    elastic = run_hint(spanning, "out", (1, 2))
    assert elastic.startswith("run it on each of 1..2 nodes:"), elastic


def test_launch_slurm_outside_slurm_is_one_line(two_nodes, tmp_path) -> None:
    """No srun (bash would say `srun: command not found`, exit 127), or srun but no job."""
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _bash(two_nodes / "launch.slurm", _bare_env(str(empty)))
    assert proc.returncode == 2, proc.stderr
    line = _one_error(proc.stderr)
    assert "srun is not on PATH" in line and "sbatch launch.slurm" in line, line
    assert "bash launch.sh" in line, line
    shims = tmp_path / "bin"
    shims.mkdir()
    called = tmp_path / "srun-called"
    (shims / "srun").write_text(f"#!/bin/sh\ntouch {called}\n")
    (shims / "srun").chmod(0o755)
    proc = _bash(two_nodes / "launch.slurm", _bare_env(f"{shims}:/usr/bin:/bin"))
    assert proc.returncode == 2 and not called.exists(), proc.stderr
    assert "SLURM_JOB_ID is unset" in _one_error(proc.stderr), proc.stderr


# ---- the rendezvous report, against a real store ---------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_with(state: _RendezvousState | bytes | None, run_id: str = "job"):
    """A TCPStore on a free port holding ``state`` as torch's c10d backend writes it (base64 of
    a pickle); bytes are stored as they are."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    if state is not None:
        bits = state if isinstance(state, bytes) else pickle.dumps(state)
        store.set(f"torch.rendezvous.{run_id}", base64.b64encode(bits))
    return store, port


def _report(port: int, monkeypatch, capsys, tmp_path, nodes: int = 2, **env: str):
    """(exit code, stderr, what AUTOPAR_ERROR_FILE got) of report_rendezvous."""
    error_file = tmp_path / "error"
    monkeypatch.setenv("RDZV_ENDPOINT", f"127.0.0.1:{port}")
    monkeypatch.setenv("RDZV_ID", "job")
    monkeypatch.setenv("AUTOPAR_ERROR_FILE", str(error_file))
    monkeypatch.delenv("AUTOPAR_NODES", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        rt.report_rendezvous(nodes, 7)
    written = error_file.read_text() if error_file.exists() else ""
    return exit_.value.code, capsys.readouterr().err, written


def _state(*addrs: str, complete: bool = False) -> _RendezvousState:
    state = _RendezvousState()
    state.participants = {_NodeDesc(addr, 100 + i, 0): i for i, addr in enumerate(addrs)}
    state.complete = complete
    return state


def test_rendezvous_report_names_the_nodes_that_arrived(monkeypatch, capsys, tmp_path) -> None:
    store, port = _store_with(_state("node3.cluster", "10.0.0.2"))
    code, err, written = _report(port, monkeypatch, capsys, tmp_path, nodes=3)
    line = _one_error(err)
    assert code == 2 and written == line.removeprefix("error: ") + "\n", err
    assert "did not complete within 7 s (RDZV_TIMEOUT_S): 2 of 3 nodes arrived" in line, line
    assert "(10.0.0.2, node3.cluster), 1 did not:" in line, line
    # under SLURM (launch.slurm lists the job's nodes), the missing one by name
    code, err, _ = _report(
        port, monkeypatch, capsys, tmp_path, 3, AUTOPAR_NODES="node3 node7 10.0.0.2"
    )
    assert code == 2 and "1 did not (node7):" in _one_error(err), err


def test_rendezvous_report_is_silent_once_it_completed(monkeypatch, capsys, tmp_path) -> None:
    store, port = _store_with(_state("a", "b", complete=True))
    assert _report(port, monkeypatch, capsys, tmp_path) == (0, "", "")


@pytest.mark.parametrize(
    ("held", "named"),
    [
        ("nothing", "nothing answers at 127.0.0.1:"),
        ("no rendezvous", "holds no rendezvous 'job'"),
        ("os.system", "system is not in a rendezvous state"),
    ],
)
def test_rendezvous_report_without_a_state(held, named, monkeypatch, capsys, tmp_path) -> None:
    """Nothing listening, a store no node joined, and a state that is not torch's (a pickle
    calling os.system is refused, not run)."""
    if held == "nothing":
        port = _free_port()
    else:
        bits = pickle.dumps(os.system) if held == "os.system" else None
        store, port = _store_with(bits)
    code, err, written = _report(port, monkeypatch, capsys, tmp_path, LOCAL_ADDR="node1")
    line = _one_error(err)
    assert code == 2 and named in line and written, line
    assert "1 of 2 nodes (node1) waited" in line, line


def test_rendezvous_state_of_a_port_held_by_another_program() -> None:
    """A server that accepts and never answers leaves a store client waiting past its own
    timeout: bounded here, and named as another program."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        accepted = []
        threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
        started = time.monotonic()
        state, why = importlib.import_module("autopar_runtime.rendezvous")._rendezvous_state(
            "127.0.0.1", port, "job", wait_s=1.0
        )
        assert time.monotonic() - started < 10
    assert state is None and "another program holds it" in why, why


# ---- launch.sh for real: one run per class ---------------------------------------------------
@pytest.mark.dist
def test_a_mistyped_flag_under_launch_sh_is_one_line_and_no_restart(one_node, tmp_path) -> None:
    """--checkpoint-dir makes launch.sh's torchrun restart crashed groups (3 times): a mistyped
    flag is no crash. Each rank stops at parse_args, rank 0 prints one line, launch.sh exits
    2, and the checkpoint directory gets nothing."""
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "abc", "--checkpoint-dir", str(ckpt)]
    rc, log = run_bounded(["bash", "launch.sh", *args], one_node, 120, DIST_TIMEOUT_S="60")
    assert rc == 2, log[-3000:]
    assert _one_error(log) == (
        "error: argument --steps: invalid int value: 'abc': see `train.py --help`"
    ), log[-3000:]
    assert "usage:" not in log and not ckpt.exists(), log[-3000:]


def _processes_holding(text: str) -> list[int]:
    """The processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile
                pass
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _steps_saved(ckpt: Path) -> set[str]:
    return {p.name for p in ckpt.glob("step_*")} if ckpt.exists() else set()


def _kill_mid_run(one_node: Path, tmp_path: Path, victim: str, sig: int) -> None:
    """A long run saving every step; once step 1 is saved, ``sig`` to ``victim`` (launch.sh, or
    its torchrun): within 30 s no process of the run is left, and no step is saved after.
    launch.sh is started from another directory with a relative --checkpoint-dir: the
    checkpoints land in the caller's directory, as with train.py run directly."""
    name = f"ckpt-{tmp_path.name}"  # relative, and in no other process's command line
    ckpt = tmp_path / name
    args = ["--steps", "100000", "--checkpoint-dir", name, "--checkpoint-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}"}
    env["DIST_TIMEOUT_S"] = "60"
    launch = subprocess.Popen(
        ["bash", str(one_node / "launch.sh"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        while not (ckpt / "step_1" / "COMPLETE").exists():
            assert launch.poll() is None, f"launch.sh ended first (rc {launch.returncode})"
            assert time.monotonic() < deadline, "no checkpoint of step 1 within 150 s"
            time.sleep(0.2)
        if victim == "launch.sh":
            os.kill(launch.pid, sig)
        else:
            torchrun = [p for p in _processes_holding(name) if _is_torchrun(p)]
            assert len(torchrun) == 1, torchrun
            os.kill(torchrun[0], sig)
        deadline = time.monotonic() + 30
        while _processes_holding(name) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _processes_holding(name)
        assert not left, f"still running 30 s after the kill: {left}"
        saved = _steps_saved(ckpt)
        time.sleep(2)
        assert _steps_saved(ckpt) == saved
        assert not (one_node / name).exists()  # not beside launch.sh: where the caller runs it
    finally:
        _kill_all(_processes_holding(name))
        if launch.poll() is None:
            launch.kill()
        launch.wait(timeout=30)


def _is_torchrun(pid: int) -> bool:
    try:
        return b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 2)[1]
    except (OSError, IndexError):
        return False


@pytest.mark.dist
def test_killing_launch_sh_stops_its_ranks(one_node, tmp_path) -> None:
    """SIGKILL to launch.sh: torchrun runs its workers in sessions of their own, so they went
    on training and saving before (issue 25); now torchrun ends with launch.sh, the ranks with
    torchrun."""
    _kill_mid_run(one_node, tmp_path, "launch.sh", signal.SIGKILL)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "sig"), [("launch.sh", signal.SIGTERM), ("torchrun", signal.SIGKILL)]
)
def test_a_launcher_stopped_otherwise_stops_its_ranks(one_node, tmp_path, victim, sig) -> None:
    _kill_mid_run(one_node, tmp_path, victim, sig)


@pytest.mark.dist
@pytest.mark.slow
def test_a_node_alone_says_who_arrived_after_rdzv_timeout(two_nodes) -> None:
    """One node of a 2-node plan started alone, hosting the rendezvous, RDZV_TIMEOUT_S=3:
    launch.sh says that 1 of 2 nodes arrived (by its LOCAL_ADDR), exits 2, starts no rank."""
    env = {"RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "RDZV_TIMEOUT_S": "3"}
    env |= {"LOCAL_ADDR": "127.0.0.1", "RDZV_ID": f"alone-{os.getpid()}"}
    started = time.monotonic()
    rc, log = run_bounded(["bash", "launch.sh", "--steps", "1"], two_nodes, 120, **env)
    assert rc == 2, log[-3000:]
    line = _one_error(log)
    assert "did not complete within 3 s" in line and "1 of 2 nodes arrived (127.0.0.1)" in line
    assert "data: " not in log and time.monotonic() - started < 90, log[-3000:]


@pytest.mark.dist
@pytest.mark.slow
def test_a_port_held_by_another_server_ends_within_the_bound(two_nodes) -> None:
    """The endpoint's port is held by a server that is no torch store (and RDZV_IS_HOST is not
    set, so torchrun connects to it as a client and would wait forever): one line, exit 2."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        threading.Thread(target=lambda: [server.accept() for _ in range(8)], daemon=True).start()
        env = {"RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_TIMEOUT_S": "3"}
        rc, log = run_bounded(["bash", "launch.sh", "--steps", "1"], two_nodes, 120, **env)
    assert rc == 2, log[-3000:]
    assert "another program holds it" in _one_error(log), log[-3000:]


@pytest.mark.dist
@pytest.mark.slow
def test_compile_without_a_compiler_under_launch_sh_is_one_line(one_node, tmp_path) -> None:
    """CXX names a missing compiler: one line before any collective, exit 2, no restart."""
    ckpt = str(tmp_path / "ckpt")
    rc, log = run_bounded(
        ["bash", "launch.sh", "--steps", "1", "--compile", "--checkpoint-dir", ckpt],
        one_node,
        120,
        CXX="/nonexistent/g++",
    )
    assert rc == 2, log[-3000:]
    assert "/nonexistent/g++" in _one_error(log), log[-3000:]
