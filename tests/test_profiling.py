"""train.py --profile-steps N (issue 27, item 1) and the library's reader of its profile.json
(cost_model/measured.py, the start of item 2).

The default tier runs one emitted plan (examples/gpt.py, fsdp=2 on 2 gloo ranks, 5 steps, 3 of
them profiled) once and checks the profile: every term with its unit, each rank's terms adding
up to its step (exactly, by construction) and agreeing with the step time the run logs on its
own clock, the remainder outside the named terms small, each memory split adding up to its
peak, the parameter bytes of the shards, the collectives with their groups. The slow tier
checks that profiling leaves the losses bitwise unchanged, and profiles a pipeline and a
tensor-parallel plan. The reader's refusals run in process.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
from pathlib import Path

import pytest
from _plans import GPT, forced_plan, gpt_layers, megatron_gpt, run_bounded, split_layers
from autopar.codegen import write_outputs
from autopar.codegen.apply import runtime
from autopar.codegen.emit import constants
from autopar.cost_model.measured import (
    MeasuredProfileError,
    check_belongs,
    compare_terms,
    load_measured,
    parse_measured,
)

TIMEOUT_S = 240
BLOCKS = [f"blocks.{i}" for i in range(4)]
GPT_PARAMS = 249_216  # examples/gpt.py's parameter count (vocab 256, dim 64, 4 blocks, 256 pos)


def _run(out: Path, *args: str) -> str:
    rc, log = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 0, log[-4000:]
    return log


def _losses(log: str) -> list[float]:
    return [json.loads(x)["loss"] for x in log.splitlines() if x.startswith('{"step"')]


def _logged(log: str) -> dict[int, float]:
    rows = [json.loads(x) for x in log.splitlines() if x.startswith('{"step"')]
    return {r["step"]: r["step_time_s"] for r in rows}


def _check_sums(profile, log: str) -> None:
    """Each rank's profiled steps: the terms partition the step; without the data wait they
    match the step time the loop logged (rank 0's clock, its own reading); what is left outside
    the named terms (zero_grad, the LR schedule) is small."""
    logged = _logged(log)
    for rank in profile.ranks:
        # over the profiled steps: one step can lose a time slice anywhere on a loaded machine
        assert rank.mean.other_s <= 0.05 * rank.mean.step_s, rank.mean
        for step in rank.steps:
            inside = step.step_s - step.data_wait_s
            assert inside == pytest.approx(step.logged_step_time_s, rel=0.05, abs=5e-3), step
            if rank.rank == 0:
                assert step.logged_step_time_s == pytest.approx(logged[step.step], abs=1e-5)
            assert all(t.forward_s > 0 and t.backward_s >= 0 for t in step.layers.values())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, str]:
    plan = forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=gpt_layers())
    out = write_outputs(plan, tmp_path_factory.mktemp("profile_fsdp"))
    return out, _run(out, "--steps", "5", "--profile-steps", "3")


def test_fsdp_profile_holds_every_term(fsdp_run) -> None:
    out, log = fsdp_run
    profile = load_measured(out / "profile.json")  # units, finite >= 0, sums: or it raises
    assert f"profile: 3 steps after 2 warm-up, written to {out / 'profile.json'}" in log
    assert profile.profiled_steps == [3, 4, 5] and profile.warmup_steps == 2
    assert profile.autopar_version == importlib.metadata.version("autopar")
    assert (profile.cluster, profile.world_size, profile.backend) == ("cpu:2", 2, "gloo")
    plan_bytes = (out / "plan.json").read_bytes()
    assert profile.plan_sha256 == hashlib.sha256(plan_bytes).hexdigest()
    assert profile.plan == json.loads(plan_bytes)
    assert profile.layers == gpt_layers()
    _check_sums(profile, log)
    for rank in profile.ranks:
        assert rank.mesh_coords["fsdp"] == rank.rank
        assert list(rank.mean.layers) == gpt_layers()
        assert rank.mean.optimizer_s > 0 and rank.mean.grad_norm_s > 0
        assert rank.mean.pipeline_s == 0
        memory = rank.memory
        assert memory.params_bytes == GPT_PARAMS * 4 // 2  # fp32, half of it on each rank
        assert memory.grads_bytes == memory.params_bytes
        assert memory.optimizer_bytes >= 2 * memory.params_bytes  # AdamW: two moments
        assert memory.activations_bytes > 0 and memory.peak_rss_bytes > memory.peak_bytes
        assert set(memory.derived) == {"peak_bytes", "activations_bytes"}
        kinds = {(c.kind, c.group, c.group_size) for c in rank.collectives}
        assert ("all_gather", "fsdp", 2) in kinds, kinds  # FSDP2's parameter gathers
        # the step's one all-reduce (loop.StepTotals): float64 [loss, norm share], and on a
        # logged step each rank's peak memory too (one slot per rank)
        sizes = {c.message_bytes for c in rank.collectives if c.kind == "all_reduce"}
        assert {16, 16 + 8 * 2} & sizes, sizes
        assert all(c.time_s > 0 and c.num_calls > 0 for c in rank.collectives)
    terms = {row.term: row for row in compare_terms(profile)}
    assert terms["memory.params"].measured == GPT_PARAMS * 2
    assert terms["step_time"].measured > terms["compute"].measured > 0


def _flags(argv: list[str], capsys) -> tuple[int | None, str]:
    """(exit code, stderr) of train.py's parse_args and check_flags; None: accepted."""
    rt = runtime()
    c = rt.Constants(**constants(forced_plan(GPT, 1, {}, {}, layers=BLOCKS)))
    try:
        rt.check_flags(c, rt.parse_args(c, "train.py", argv))
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return None, capsys.readouterr().err


def test_profile_flags(tmp_path: Path, capsys) -> None:
    """N >= 1 with a warm-up step left; --profile-out never replaces a file autopar did not
    write (a previous profile of ours it does), nor names a directory."""
    theirs, ours = tmp_path / "notes.json", tmp_path / "profile.json"
    theirs.write_text('{"mine": true}\n')
    ours.write_text(json.dumps({"kind": "autopar-profile", "schema": 1}))
    refused = [
        (["--profile-steps", "0"], "--profile-steps 0 must be >= 1"),
        (["--steps", "4", "--profile-steps", "3"], "--steps (4) >= N + 2"),
        (["--profile-steps", "abc"], "--profile-steps: invalid int value"),
        (["--profile-out", str(ours)], "--profile-out needs --profile-steps"),
        (["--profile-steps", "2", "--profile-out", str(theirs)], "is not a profile autopar"),
        (["--profile-steps", "2", "--profile-out", str(tmp_path)], "is a directory"),
    ]
    for argv, named in refused:
        code, err = _flags(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and named in err, (argv, err)
    assert _flags(["--profile-steps", "2", "--profile-out", str(ours)], capsys) == (None, "")
    assert _flags(["--steps", "4", "--profile-steps", "2"], capsys) == (None, "")


# ---- the reader's refusals (in process) -----------------------------------------------------
def _document(tmp_path: Path) -> dict:
    """A small valid profile: one rank, one layer, one step."""
    step = {"step_s": 1.0, "logged_step_time_s": 0.9, "data_wait_s": 0.1, "forward_other_s": 0.1,
            "backward_other_s": 0.1, "pipeline_s": 0.0, "grad_norm_s": 0.1, "optimizer_s": 0.2,
            "other_s": 0.0, "layers": {"l0": {"forward_s": 0.1, "backward_s": 0.3}}}  # fmt: skip
    memory = {"source": "cpu_allocations", "peak_bytes": 100, "params_bytes": 10,
              "grads_bytes": 10, "optimizer_bytes": 20, "activations_bytes": 55, "buffers_bytes": 5,
              "peak_rss_bytes": 1000, "runtime_rss_bytes": 500,
              "measured": ["params_bytes"], "derived": ["activations_bytes"]}  # fmt: skip
    plan = {"model": {"file": "/m/gpt.py", "factory": "build_model"},
            "predicted": {"step_time_s": 0.5, "time_breakdown_s": {"compute": 0.4},
                          "memory_breakdown_bytes": {"params": 10}}}  # fmt: skip
    return {
        "kind": "autopar-profile", "schema": 1, "autopar_version": "0.1.0",
        "torch_version": "2.13.0", "cluster": "cpu:1", "world_size": 1, "backend": "gloo",
        "device_type": "cpu", "clock": "perf_counter", "mesh": {"pp": 1, "fsdp": 1},
        "plan_sha256": "0" * 64, "plan": plan, "warmup_steps": 1, "profiled_steps": [2],
        "collectives_source": None, "layers": ["l0"],
        "ranks": [{"rank": 0, "mesh_coords": {"pp": 0}, "mean": step,
                   "steps": [{**step, "step": 2, "memory": memory}], "memory": memory,
                   "collectives": []}],
    }  # fmt: skip


def _refused(text: str, *words: str) -> str:
    with pytest.raises(MeasuredProfileError) as e:
        parse_measured(text, "p.json")
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line
    return line


def test_reader_accepts_a_valid_profile_and_compares_it(tmp_path: Path) -> None:
    profile = parse_measured(json.dumps(_document(tmp_path)))
    rows = {r.term: r for r in compare_terms(profile)}
    assert rows["step_time"].measured == pytest.approx(0.9)
    assert rows["step_time"].ratio == pytest.approx(1.8)
    assert rows["compute"].measured == pytest.approx(0.6)
    assert rows["memory.params"].ratio == 1.0 and rows["grad_norm"].predicted is None


def test_reader_refuses_malformed_input(tmp_path: Path) -> None:
    doc = _document(tmp_path)
    _refused("{not json", "not valid JSON")
    _refused('{"kind": "autopar-profile", "kind": 1}', "twice")
    _refused(json.dumps({"schema": 1}), "no run's profile")
    _refused(json.dumps({"version": 1, "samples": []}), "a cluster profile (plan profile)")
    _refused(json.dumps({**doc, "schema": 2}), "schema 2")
    nan = json.dumps(doc).replace('"optimizer_s": 0.2', '"optimizer_s": NaN', 1)
    _refused(nan, "NaN")
    negative = copy.deepcopy(doc)
    negative["ranks"][0]["memory"]["buffers_bytes"] = -5
    _refused(json.dumps(negative), "buffers_bytes")
    unsummed = copy.deepcopy(doc)
    unsummed["ranks"][0]["mean"]["optimizer_s"] = 0.5
    _refused(json.dumps(unsummed), "sum to")
    unitless = copy.deepcopy(doc)
    unitless["ranks"][0]["mean"]["optimizer"] = unitless["ranks"][0]["mean"].pop("optimizer_s")
    _refused(json.dumps(unitless), "optimizer")
    missing_rank = {**doc, "world_size": 2, "mesh": {"fsdp": 2}}
    _refused(json.dumps(missing_rank), "ranks")


def test_reader_refuses_another_model_cluster_or_version(tmp_path: Path) -> None:
    profile = parse_measured(json.dumps(_document(tmp_path)))
    same = {"model": {"file": "/m/gpt.py", "factory": "build_model"}, "cluster": "cpu:1"}
    check_belongs(profile, **same, autopar_version="0.1.0")
    cases = [
        ({**same, "model": {"file": "/m/llama.py"}}, "model"),
        ({**same, "cluster": "8xH100"}, "cluster"),
        ({**same}, "autopar 0.2.0"),
    ]
    for kwargs, word in cases:
        version = "0.2.0" if word.startswith("autopar") else "0.1.0"
        with pytest.raises(MeasuredProfileError, match=word):
            check_belongs(profile, **kwargs, autopar_version=version)


# ---- slow: numerics unchanged, pipeline and tensor parallel ---------------------------------
@pytest.mark.slow
def test_profiling_leaves_the_losses_bitwise_equal(fsdp_run) -> None:
    out, log = fsdp_run
    plain = _run(out, "--steps", "5")
    assert _losses(plain) == _losses(log) and len(_losses(log)) == 5


@pytest.mark.slow
def test_pipeline_profile(tmp_path: Path) -> None:
    layers = gpt_layers()
    plan = forced_plan(
        GPT, 2, {"pp": 2}, {}, layers=layers, stages=split_layers(layers, 2),
        schedule={"name": "1f1b", "num_microbatches": 2, "stages_per_rank": 1},
    )  # fmt: skip
    out = write_outputs(plan, tmp_path)
    log = _run(out, "--steps", "6", "--profile-steps", "4")
    profile = load_measured(out / "profile.json")
    _check_sums(profile, log)
    for rank, stage in zip(profile.ranks, split_layers(layers, 2)):
        assert list(rank.mean.layers) == stage  # each rank times its own stage's layers
        assert rank.mean.pipeline_s > 0
        assert any(c.kind in ("send", "recv") and c.group == "pp" for c in rank.collectives)
    assert {r.term for r in compare_terms(profile)} >= {"stage0.forward", "stage1.backward"}


def test_tensor_parallel_profile(tmp_path: Path) -> None:
    """Megatron pairs on examples/gpt.py at tp=2, profiled: every term, and the TP group's
    all-reduces of the hidden states (8 x 16 x 64 fp32) as the cost model counts them: per block
    the attention's and the MLP's outputs (rowwise) forward, and backward one for each input
    that colwise projections read, q, k and v sharing theirs (18 a step; 26 when each
    projection reduced its own); the embedding's output and the head's input one each."""
    plan = forced_plan(
        GPT, 2, {"tp": 2}, megatron_gpt(), layers=gpt_layers(),
        module_attrs={f"{b}.attn": {"n_head": 2} for b in BLOCKS},
    )  # fmt: skip
    out = write_outputs(plan, tmp_path)
    log = _run(out, "--steps", "4", "--profile-steps", "2")
    profile = load_measured(out / "profile.json")
    _check_sums(profile, log)
    hidden = 8 * 16 * 64 * 4
    for rank in profile.ranks:
        calls = sum(c.num_calls for c in rank.collectives
                    if (c.group, c.kind, c.message_bytes) == ("tp", "all_reduce", hidden))  # fmt: skip
        assert calls == 4 * len(BLOCKS) + 2, rank.collectives


@pytest.mark.slow
def test_expert_parallel_profile(tmp_path: Path) -> None:
    """Under ep the all-to-alls run on the ep group, carved from the data-parallel ranks outside
    the training mesh: the profile names them (group "ep", its size), so ep_comm is measured and
    a refit sees them."""
    from autopar.api import plan_model_file

    plan = plan_model_file(str(Path(__file__).parent / "models" / "moe.py"), "cpu:2",
                           global_batch=4, seq_len=16, mesh={"ep": 2})  # fmt: skip
    out = write_outputs(plan, tmp_path / "run")
    log = _run(out, "--steps", "4", "--profile-steps", "2")
    profile = load_measured(out / "profile.json")
    _check_sums(profile, log)
    for rank in profile.ranks:
        ep = [c for c in rank.collectives if c.group == "ep"]
        assert ep and all(c.kind.startswith("all") and c.group_size == 2 for c in ep), ep
        assert any(c.message_bytes > 64 for c in ep)  # the tokens, not only the routing ids
        assert rank.mesh_coords["ep"] == rank.rank
    ep_row = next(r for r in compare_terms(profile) if r.term == "ep_comm")
    assert ep_row.measured > 0 and ep_row.predicted
