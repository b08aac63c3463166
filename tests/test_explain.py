"""``--explain`` / ``plan.explain()``, ``--why-not`` / ``plan.why_not()``, the timeline, and the
CLI's output discipline: ``--json`` stays one JSON document while the progress line runs."""

from __future__ import annotations

import json
import math
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
from _plans import GPT
from autopar.cost_model import MemoryBreakdown
from autopar.planner import explain as ex
from autopar.planner.plan import Schedule, StagePrediction

from autopar import Plan
from autopar.api import plan_model_file, why_not
from autopar.cli import main
from autopar.model_file import load_model_file

BIN = Path(sys.executable).parent
LOST_BY = {"slower", "idle_tp", "pruned", "memory", "constraint"}


@pytest.fixture(scope="module")
def plan() -> Plan:
    return plan_model_file(load_model_file(GPT), "cpu:4", global_batch=8, seq_len=64)


@pytest.fixture(scope="module")
def pp_plan() -> Plan:
    mf = load_model_file(GPT)
    return plan_model_file(mf, "cpu:4", global_batch=8, seq_len=64, mesh="pp=2", checkpoint="full")


def test_parts_sum_to_predicted_step_time(plan, pp_plan):
    for p in (plan, pp_plan):
        e = ex.explain(p)
        assert math.isclose(sum(e.time_parts.values()), p.predicted.step_time_s, rel_tol=1e-9)
        assert set(e.time_parts) >= {"compute", "recompute", "tp_comm", "dp_comm", "pp_comm",
                                     "bubble", "optimizer"}  # fmt: skip
        assert all(v >= 0 for v in e.time_parts.values())
        for a in p.alternatives:  # the alternatives' parts sum to their step times too
            if a.time_breakdown_s is not None:
                total = sum(a.time_breakdown_s.parts().values())
                assert math.isclose(total, a.step_time_s, rel_tol=1e-9), a
    # checkpointing every layer shows up as recompute, and the pipeline's parts are nonzero
    parts = ex.explain(pp_plan).time_parts
    assert parts["recompute"] > 0 and parts["bubble"] > 0 and parts["pp_comm"] > 0


def test_each_alternative_names_why_it_lost(plan):
    e = ex.explain(plan)
    assert len(e.alternatives) >= 5
    parts = set(e.time_parts)
    for a in e.alternatives:
        assert a.why and a.lost_by in LOST_BY, a
        if a.lost_by == "slower":  # the cost part that differs, by name
            assert any(f"mostly {part}" in a.why for part in parts), a.why
    for line in (f"{i}  {a.label}" for i, a in enumerate(e.alternatives, 1)):
        assert line in e.text
    assert all(a.why in e.text for a in e.alternatives)


def test_explain_text_shows_breakdowns_against_capacity(pp_plan):
    text = pp_plan.explain()
    for heading in ("step time", "per stage, one microbatch", "memory per pipeline rank"):
        assert heading in text
    e = ex.explain(pp_plan)
    assert [rm.rank for rm in e.rank_memory] == [0, 1]
    assert e.capacity_bytes == pp_plan.cluster.device.memory_bytes
    peak = max(rm.memory.total for rm in e.rank_memory)
    assert peak == pp_plan.predicted.peak_memory_bytes
    assert "of device" in text


def test_a_constraint_is_named(plan):
    """A mesh ruled out by a rule says which (here: heads not divisible)."""
    mf = load_model_file(GPT)
    odd = plan_model_file(mf, "cpu:3", global_batch=6, seq_len=16)
    ruled = [a for a in ex.explain(odd).alternatives if a.lost_by == "constraint"]
    assert ruled and any("attention heads" in a.why for a in ruled)


def test_why_not_diffs_the_forced_plan(plan):
    w = why_not(plan, "fsdp=4")
    assert w.forced is not None and w.forced.mesh.fsdp == 4
    times = {name: (x, y) for section, name, x, y in w.rows if section == "time"}
    assert math.isclose(times["step time"][1], w.forced.predicted.step_time_s)
    forced_parts = sum(y for name, (_, y) in times.items() if name != "step time")
    assert math.isclose(forced_parts, w.forced.predicted.step_time_s, rel_tol=1e-9)
    assert "slower, mostly dp_comm" in w.verdict
    assert "verdict:" in w.text and "memory: peak" in w.text


def test_why_not_impossible_pins_is_a_verdict(plan):
    w = why_not(plan, "tp=3")
    assert w.forced is None and "ruled out" in w.verdict and "tp=3" in w.verdict


def test_why_not_on_a_loaded_plan_retraces_the_model_file(plan):
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan
    w = why_not(loaded, "dp=2,fsdp=2")
    assert w.forced is not None and (w.forced.mesh.dp, w.forced.mesh.fsdp) == (2, 2)


def test_why_not_answers_alike_for_a_fresh_and_a_loaded_plan():
    """A fresh plan with checkpointing pinned and the same plan loaded from JSON get the same
    verdict; a session that traced the model answers both without tracing again."""
    import autopar.api as api

    session = api.PlanningSession()
    mf = load_model_file(GPT)
    fresh = plan_model_file(
        mf, "cpu:4", global_batch=8, seq_len=64, checkpoint="full", session=session
    )
    loaded = Plan.from_json(fresh.to_json())
    retraced = [why_not(p, "fsdp=4") for p in (fresh, loaded)]
    assert session.traces == 1
    reused = [why_not(p, "fsdp=4", session=session) for p in (fresh, loaded)]
    assert session.traces == 1  # the session holds this plan's graph: no trace needed
    texts = {w.text for w in retraced + reused}
    assert len(texts) == 1, texts
    forced = retraced[0].forced
    assert forced is not None and forced.mesh.fsdp == 4
    assert all(w.forced is not None and w.forced.predicted == forced.predicted for w in reused)


def test_cli_explain_and_why_not(capsys):
    args = [GPT, "--cluster", "cpu:4", "--global-batch", "8", "--seq-len", "64"]
    assert main([*args, "--explain", "--why-not", "fsdp=4"]) == 0
    out, err = capsys.readouterr()
    assert out.index("mesh") < out.index("step time\n") < out.index("why not fsdp=4?")
    assert "why it lost" in out and "verdict:" in out and not err.strip()
    assert main([*args, "--why-not", "tp=two"]) == 2  # a bad mesh is a user error
    _, err = capsys.readouterr()
    assert err.startswith("error:") and "'tp=two'" in err, err
    assert len(err.strip().splitlines()) == 1


def test_cli_quiet_prints_only_what_was_asked(capsys):
    args = [GPT, "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16", "-q"]
    assert main(args) == 0
    assert capsys.readouterr() == ("", "")
    assert main([*args, "--explain"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("why ") and "model " not in out and err == ""


def test_json_stays_clean_while_progress_and_explain_run(tmp_path):
    """stderr on a terminal (a pty): the progress line is drawn there, the explanation goes
    there too, and stdout is exactly one JSON document."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(BIN / "plan"), GPT, "--cluster", "cpu:4", "--global-batch", "8", "--seq-len", "64",
         "--json", "--explain", "--why-not", "dp=2,fsdp=2"],
        stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    os.close(slave)
    err = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            pytest.fail("plan printed nothing on stderr for 120 s")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not chunk:
            break
        err += chunk
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0, err.decode()[-2000:]
    os.close(master)
    raw = json.loads(out)  # the whole of stdout
    assert raw["version"] == 1
    text = err.decode()
    assert "plan: scoring mesh" in text and "\x1b[2K" in text  # the progress line ran
    assert "why it lost" in text and "why not dp=2,fsdp=2?" in text


def test_no_progress_when_stderr_is_not_a_terminal(tmp_path):
    proc = subprocess.run(
        [str(BIN / "plan"), GPT, "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0
    assert "\x1b" not in proc.stderr and "\r" not in proc.stderr


# -- the timeline, on hand-made stage predictions (every schedule, no search) ------------------


def _pipeline(schedule: str, p: int, v: int, m: int) -> Plan:
    stages = [
        StagePrediction(
            rank=(j if j < p else 2 * p - 1 - j) if schedule in ("zbv", "dualpipev") else j % p,
            fwd_s=1e-3,
            bwd_s=2e-3,
            bwd_weight_s=1e-3,
            memory_bytes=1,
            in_flight=1,
        )
        for j in range(p * v)
    ]
    base = plan_stub()
    predicted = base.predicted.model_copy(
        update={"stages": stages, "rank_memory_bytes": [base.predicted.memory_breakdown_bytes] * p}
    )
    mesh = base.mesh.model_copy(update={"pp": p, "dp": 1, "fsdp": 1, "tp": 1})
    return base.model_copy(
        update={
            "mesh": mesh,
            "predicted": predicted,
            "schedule": Schedule(name=schedule, num_microbatches=m, stages_per_rank=v),
            "stages": [["x"]] * (p * v),
        }
    )


_STUB: list[Plan] = []


def plan_stub() -> Plan:
    if not _STUB:
        from _plans import forced_plan

        _STUB.append(forced_plan(GPT, 1, {}, {}, layers=["blocks.0"]))
    stub = _STUB[0]
    mem = MemoryBreakdown(params=1, grads=1, optimizer=1, activations=1, buffers=0)
    return stub.model_copy(
        update={"predicted": stub.predicted.model_copy(update={"memory_breakdown_bytes": mem})}
    )


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m"),
    [("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved-1f1b", 2, 2, 4), ("zbv", 2, 2, 4),
     ("dualpipev", 2, 2, 4)],
)  # fmt: skip
def test_timeline_replays_every_schedule(schedule, p, v, m):
    blocks = ex.timeline(_pipeline(schedule, p, v, m))
    work = [b for b in blocks if b.stage is not None]
    fwd = {(b.stage, b.microbatch): b for b in work if b.kind == "F"}
    bwd = {(b.stage, b.microbatch): b for b in work if b.kind in ("B", "I")}
    assert len(fwd) == len(bwd) == p * v * m  # every stage runs every microbatch once
    for (j, k), b in fwd.items():
        if j > 0:
            assert b.start_s >= fwd[(j - 1, k)].end_s - 1e-12  # input ready
    for (j, k), b in bwd.items():
        before = bwd[(j + 1, k)] if j + 1 < p * v else fwd[(j, k)]
        assert b.start_s >= before.end_s - 1e-12
    for r in range(p):  # a rank runs one thing at a time
        mine = sorted((b for b in blocks if b.rank == r), key=lambda b: b.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))
    busy = sum(b.end_s - b.start_s for b in work)
    span = max(b.end_s for b in work)
    assert busy < p * span  # the fill and drain leave bubbles
