"""Elastic runs (issue 29): ``plan --elastic MIN:MAX`` plans every node count and emits them all;
``launch.sh`` starts torchrun's elastic agent, and a worker takes the plan for the nodes it finds
and resumes from the latest complete checkpoint, saying so in one JSON line.

The cheap part plans a tiny MLP for 2..3 nodes of one rank (the files, the table, a world
outside the range). The runs use two hosts made of network namespaces joined by a veth pair, as
tests/test_multinode.py does (its docstring says why each knob is set): a host taken away after
a checkpoint, the other finishing alone under the 1-node plan with the losses of a fresh 1-node
run resumed from that checkpoint, bitwise; and a host joining a run, which resumes under the
2-node plan.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _netns import host_env, two_hosts
from autopar.codegen.apply import runtime

from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
MLP = ROOT / "examples" / "mlp.py"
_SUBNET = "10.213.9"


def _cluster(path: Path, nodes: int, per_node: int) -> Path:
    gloo = {"name": "gloo", "bandwidth_bytes_per_s": 2e9, "latency_s": 4e-4}
    veth = {"name": "veth", "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}
    spec = {"device": "cpu", "num_nodes": nodes, "devices_per_node": per_node}
    path.write_text(json.dumps({**spec, "intra_node": gloo, "inter_node": veth}))
    return path


# -- planning and emitting (default tier) -------------------------------------------------------


def test_elastic_plans_every_node_count_and_refuses_a_world_outside(tmp_path, capsys, monkeypatch):
    cluster = _cluster(tmp_path / "nodes.json", 1, 1)
    out = tmp_path / "out"
    argv = [str(MLP), "--cluster", str(cluster), "--global-batch", "6"]
    report = tmp_path / "report.html"
    assert (
        main([*argv, "--elastic", "2:3", "--out", str(out), "--explain", "--report", str(report)])
        == 0
    )
    text = capsys.readouterr().out
    page = report.read_text()
    assert "<h2>Elastic: 2 to 3 nodes</h2>" in page and page.count("<td>dp=") == 2, page[-3000:]
    # --explain: a row per node count, largest first, with its mesh and predicted throughput
    table = text[text.index("elastic plans for 2..3 nodes") :].splitlines()
    rows = [line.split() for line in table[3:5]]
    assert [r[:2] for r in rows] == [["3", "3"], ["2", "2"]], table
    plans = {k: json.loads((out / "plans" / f"{k}nodes.json").read_text()) for k in (2, 3)}
    for k, plan in plans.items():
        assert plan["cluster"]["num_nodes"] == k and plan["training"]["global_batch"] == 6
        assert f"{plan['predicted']['step_time_s'] * 1e3:.3f} ms" in " ".join(table)
    assert plans[2]["training"] == plans[3]["training"]
    # train.py and plan.json are the largest node count's; each program names all of them
    assert (out / "train.py").read_text() == (out / "plans" / "3nodes.py").read_text()
    assert json.loads((out / "plan.json").read_text()) == plans[3]
    two = (out / "plans" / "2nodes.py").read_text()
    assert "WORLD_SIZE = 2\n" in two
    assert 'ELASTIC_PLANS = {"2": "plans/2nodes.py", "3": "plans/3nodes.py"}' in two
    assert "--nnodes 2:3 " in (out / "launch.sh").read_text()
    assert "#SBATCH --nodes=2-3\n" in (out / "launch.slurm").read_text()
    # the program's start (in this process: the slow tests below run it for real): a world of
    # 1 node is outside 2..3, one line and exit 2; in a world of 2 nodes it runs 2nodes.py
    rt = runtime()
    plan = rt.Constants.from_namespace(runpy.run_path(str(out / "train.py"), run_name="elastic"))
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stop:
        rt.take_elastic_plan(plan, str(out / "train.py"))
    errors = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(errors) == 1, errors
    assert "this run has 1 node(s)" in errors[0] and "for 2 to 3 nodes" in errors[0], errors
    ran = []
    monkeypatch.setattr(rt.launch.runpy, "run_path", lambda path, run_name: ran.append(path))
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stop:
        rt.take_elastic_plan(plan, str(out / "train.py"))
    assert stop.value.code == 0 and ran == [str(out.resolve() / "plans" / "2nodes.py")]
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    rt.take_elastic_plan(plan, str(out / "train.py"))  # its own node count: train.py goes on
    # a single plan emitted over it later (here the 2-node one, saved) takes plans/ away
    assert main(["--plan", str(out / "plans" / "2nodes.json"), "--out", str(out), "-q"]) == 0
    assert not (out / "plans").exists() and "ELASTIC" not in (out / "train.py").read_text()


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "given, words",
    [("3:2", "1 <= MIN <= MAX"), ("0:2", "1 <= MIN <= MAX"), ("two", "is not MIN:MAX")],
)
def test_elastic_range_that_is_not_one(tmp_path, capsys, given, words):
    argv = [str(MLP), "--cluster", "cpu:2", "--global-batch", "4", "--elastic", given]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --elastic") and words in err[0], err
    assert not (tmp_path / "out").exists()


# -- two hosts (slow tier) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces joined by a veth pair: [(namespace, interface, address)]."""
    yield from two_hosts("ae", _SUBNET, _kill_host)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory) -> Path:
    """GPT planned for 1..2 nodes of 2 ranks."""
    where = tmp_path_factory.mktemp("elastic")
    cluster = _cluster(where / "nodes.json", 2, 2)
    out = where / "out"
    argv = [str(GPT), "--cluster", str(cluster), "--global-batch", "8", "--seq-len", "32"]
    assert main([*argv, "--elastic", "1:2", "--out", str(out), "-q"]) == 0
    return out


def _start(host, index: int, command: list[str], extra: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", host[0], *command],
        env=host_env(host, index, _SUBNET, f"elastic-{os.getpid()}", extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill_host(ns: str) -> None:
    """Every process of the namespace, at once: the host is gone."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"ran over {timeout} s:\n{text[-4000:]}")
    return proc.returncode, text


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            outputs = [p.communicate()[0][-3000:] for p in procs]
            pytest.fail(f"{path} never appeared:\n" + "\n---\n".join(outputs))
        time.sleep(0.2)


def _records(text: str, key: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith(f'{{"{key}"')]


def _losses_after_last_start(text: str) -> dict[int, float]:
    """The steps the last attempt logged (after its elastic line): step -> loss, exactly."""
    last = text.rindex('{"elastic"')
    return {r["step"]: r["loss"] for r in _records(text[last:], "step")}


@pytest.mark.slow
@pytest.mark.dist
def test_lost_host_finishes_alone_under_the_one_node_plan(hosts, elastic, tmp_path):
    """2 hosts x 2 ranks train dp=4 with checkpoints every 2 steps; after step 3 the second host
    is taken away. The first one's torchrun restarts alone, runs plans/1nodes.py, resumes from
    step 2 (1 step lost), finishes the 6 steps, and logs the losses of a fresh 1-node run
    resumed from that same checkpoint, bit for bit."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "stopped"
    launch = ["bash", str(elastic / "launch.sh"), "--steps", "6", "--optimizer", "sgd"]
    launch += ["--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)]
    quick = {"RDZV_LAST_CALL_S": "10"}
    stop = {"AUTOPAR_TEST_STOP_AT_STEP": "3", "AUTOPAR_TEST_KILL_MARKER": str(marker)}
    procs = [_start(hosts[0], 0, launch, quick), _start(hosts[1], 1, launch, quick | stop)]
    _wait_for(marker, procs)
    _kill_host(hosts[1][0])
    rc, alone = _finish(procs[0])
    gone = _finish(procs[1])[1]
    assert rc == 0, alone[-4000:]
    # rank 0, which logs, was on either host before: the 2-node start is in one of the outputs
    (before,) = [s for s in _records(alone + gone, "elastic") if s["nodes"] == 2]
    last = _records(alone, "elastic")[-1]
    assert last["nodes"] == 1 and last["mesh"] == {"pp": 1, "dp": 2, "fsdp": 1, "tp": 1}, alone
    assert last["previous_mesh"] == before["mesh"] == {"pp": 1, "dp": 4, "fsdp": 1, "tp": 1}
    assert last["previous_nodes"] == 2, last
    assert last["resumed_from_step"] == 2 and last["steps_lost"] == 1, last
    after = _losses_after_last_start(alone)
    assert sorted(after) == [3, 4, 5, 6], alone[-4000:]

    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    shutil.copytree(ckpt / "step_2", fresh / "step_2")
    again = [*launch[:-1], str(fresh)]
    rc, text = _finish(_start(hosts[0], 0, again, {"RDZV_LAST_CALL_S": "1"}))
    assert rc == 0, text[-4000:]
    (start,) = _records(text, "elastic")
    assert start["nodes"] == 1 and start["resumed_from_step"] == 2
    assert start["previous_world_size"] == 4  # from the checkpoint's own marker
    assert _losses_after_last_start(text) == after  # floats from JSON: bit for bit


@pytest.mark.slow
@pytest.mark.dist
def test_joining_host_resumes_under_the_two_node_plan(hosts, elastic, tmp_path):
    """One host trains alone (plans/1nodes.py); once it has saved a checkpoint a second host
    starts launch.sh: the agent restarts the group on both, which take plans/2nodes.py (dp=4),
    resume from the latest checkpoint and finish the steps."""
    ckpt = tmp_path / "ckpt"
    launch = ["bash", str(elastic / "launch.sh"), "--steps", "30", "--optimizer", "sgd"]
    launch += ["--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)]
    slow = {"RDZV_LAST_CALL_S": "2", "AUTOPAR_TEST_STEP_SLEEP_S": "0.5"}
    first = _start(hosts[0], 0, launch, slow)
    _wait_for(ckpt / "step_2" / "COMPLETE", [first])
    second = _start(hosts[1], 1, launch, slow)
    results = [_finish(first), _finish(second)]
    for rc, text in results:
        assert rc == 0, text[-4000:]
    text = results[0][1]
    starts = _records(text, "elastic")
    assert [s["nodes"] for s in starts] == [1, 2], text[-4000:]
    joined = starts[-1]
    assert joined["mesh"] == {"pp": 1, "dp": 4, "fsdp": 1, "tp": 1}
    assert joined["previous_nodes"] == 1 and joined["previous_mesh"] == starts[0]["mesh"]
    assert joined["resumed_from_step"] >= 2 and joined["resumed_from_step"] % 2 == 0
    after = _losses_after_last_start(text)
    assert sorted(after) == list(range(joined["resumed_from_step"] + 1, 31)), text[-4000:]
