"""--data: the readers (token files, save_to_disk / parquet / jsonl input_ids), the sample order
(seeded epochs, disjoint data-parallel shares, resumable positions) and the bad-input errors.

Unit tests import the runtime module directly; the torchrun tests run an emitted script on a
.bin token file (kill and resume, DP shares, eval loss).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from _plans import GPT, forced_plan, run_bounded
from autopar.codegen import write_outputs
from autopar.codegen.apply import runtime

rt = runtime()  # the emitted autopar_runtime.py, imported as train.py imports it
SEQ = 8


def _bin(path: Path, tokens) -> Path:
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


def test_bin_windows_are_shifted_pairs(tmp_path: Path) -> None:
    tokens = np.arange(1000) % 97
    ds = rt.open_dataset(_bin(tmp_path / "train.bin", tokens), SEQ, vocab_size=97)
    assert len(ds) == (1000 - 1) // SEQ
    for i in (0, 5, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.int64 and x.shape == (SEQ,)
        assert x.tolist() == tokens[i * SEQ : (i + 1) * SEQ].tolist()
        assert y.tolist() == tokens[i * SEQ + 1 : (i + 1) * SEQ + 1].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_npy_uint32_is_memory_mapped(tmp_path: Path) -> None:
    tokens = (np.arange(200, dtype=np.uint32) * 1000) % 70000
    np.save(tmp_path / "t.npy", tokens)
    ds = rt.open_dataset(tmp_path / "t.npy", SEQ)
    assert isinstance(ds.chunks[0], np.memmap)
    assert ds[3][0].tolist() == tokens[24:32].tolist()
    assert ds.max_token() == int(tokens.max())


def test_jsonl_parquet_and_save_to_disk_concatenate_rows(tmp_path: Path) -> None:
    rows = [list(range(k * 10, k * 10 + 5 + k)) for k in range(6)]  # ragged rows
    flat = [t for row in rows for t in row]
    expect = [flat[i * SEQ : (i + 1) * SEQ] for i in range((len(flat) - 1) // SEQ)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": rows, "text": ["x"] * 6}), tmp_path / "d.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "saved")
    split = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"input_ids": rows}),
        validation=datasets.Dataset.from_dict({"input_ids": rows[:3]}),
    )
    split.save_to_disk(tmp_path / "dict")
    for source in ("d.jsonl", "d.parquet", "saved", "dict"):
        ds = rt.open_dataset(tmp_path / source, SEQ, vocab_size=100)
        assert [ds[i][0].tolist() for i in range(len(ds))] == expect, source
    val = rt.open_dataset(tmp_path / "dict", 4, split="eval")
    assert val.num_tokens == sum(len(r) for r in rows[:3])
    parquet_dir = tmp_path / "parts"
    parquet_dir.mkdir()
    pq.write_table(pa.table({"input_ids": rows[:3]}), parquet_dir / "a.parquet")
    pq.write_table(pa.table({"input_ids": rows[3:]}), parquet_dir / "b.parquet")
    ds = rt.open_dataset(parquet_dir, SEQ)
    assert [ds[i][0].tolist() for i in range(len(ds))] == expect


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "does not exist"),
        ("odd", "odd count"),
        ("short", "fewer than one window"),
        ("vocab", "token id 500, but the model's vocabulary has 100"),
        ("no_column", "no input_ids column"),
        ("npy_float", "1-D uint16 or uint32"),
        ("suffix", "unknown data format"),
        ("jsonl_field", "line 1 has no input_ids field"),
    ],
)
def test_bad_data_is_one_input_error(tmp_path: Path, case: str, match: str) -> None:
    path = tmp_path / "train.bin"
    if case == "odd":
        path.write_bytes(b"\x01\x00\x02")
    elif case == "short":
        _bin(path, range(SEQ))
    elif case == "vocab":
        _bin(path, [1, 2, 500] * 10)
    elif case == "no_column":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": ["a", "b"]}), path)
    elif case == "npy_float":
        path = tmp_path / "t.npy"
        np.save(path, np.zeros(100, dtype=np.float32))
    elif case == "suffix":
        path = tmp_path / "t.txt"
        path.write_text("hello")
    elif case == "jsonl_field":
        path = tmp_path / "t.jsonl"
        path.write_text('{"ids": [1, 2]}\n')
    with pytest.raises(rt.InputError, match=match) as info:
        rt.open_dataset(path, SEQ, vocab_size=100)
    assert "\n" not in str(info.value)


def test_dp_shares_are_disjoint_and_cover_each_epoch() -> None:
    n, batch, dp, seed = 37, 8, 4, 3
    seen_epoch: list[int] = []
    for step in range(1, 10):
        shares = [
            [rt.sample_at(p, n, seed) for p in rt.step_positions(step, batch, r, dp)]
            for r in range(dp)
        ]
        flat = [s for share in shares for s in share]
        assert all(len(share) == batch // dp for share in shares)
        positions = range((step - 1) * batch, step * batch)
        assert flat == [rt.sample_at(p, n, seed) for p in positions]  # rank order = global batch
        seen_epoch += flat
    # the first epoch (n positions) is a permutation of all samples; the next one another
    assert sorted(seen_epoch[:n]) == list(range(n))
    assert seen_epoch[n : 2 * n - 10] != seen_epoch[: n - 10]
    # another seed, another order; the same seed, the same order
    other = [rt.sample_at(p, n, seed + 1) for p in range(n)]
    assert other != seen_epoch[:n]
    assert [rt.sample_at(p, n, seed) for p in range(n)] == seen_epoch[:n]


def test_resumed_sampler_continues_the_stream() -> None:
    """A loader started at a checkpoint (step 5, position 40) yields what the uninterrupted one
    yields from step 6 on, and with another global batch continues at the same position."""
    ds = rt.TokenWindows([np.arange(400) % 50], SEQ, "mem")
    full = rt.make_loader(
        ds, global_batch=8, dp_rank=1, dp_size=2, seed=0, first=1, last=9, start=(0, 0), workers=0
    )
    resumed = rt.make_loader(
        ds, global_batch=8, dp_rank=1, dp_size=2, seed=0, first=6, last=9, start=(5, 40), workers=2
    )
    a = [b[0][0] for b in full][5:]
    b = [b[0][0] for b in resumed]
    assert len(a) == len(b) == 4 and all(torch.equal(x, y) for x, y in zip(a, b))
    wide = rt.StepSampler(len(ds), 16, 0, 1, 0, first=6, last=6, start=(5, 40))
    assert next(iter(wide)) == [rt.sample_at(p, len(ds), 0) for p in range(40, 56)]


def test_eval_loader_reads_the_first_batches_in_order(tmp_path: Path) -> None:
    ds = rt.open_dataset(_bin(tmp_path / "val.bin", np.arange(300) % 50), SEQ)
    batches = list(rt.eval_loader(ds, global_batch=4, dp_rank=1, dp_size=2))
    assert len(batches) == rt.EVAL_BATCHES
    assert batches[0][0][0].tolist() == [ds[2][0].tolist(), ds[3][0].tolist()]
    with pytest.raises(rt.InputError, match="fewer than one global batch"):
        rt.eval_loader(ds, global_batch=len(ds) + 1, dp_rank=0, dp_size=1)


def _args(**flags) -> argparse.Namespace:
    defaults = dict(data=None, eval_data=None, eval_every=None, data_workers=2, seed=0)
    return argparse.Namespace(**{**defaults, "init_from": None, "save_hf": None, **flags})


PLAN = types.SimpleNamespace(
    HF_CONFIG=None,
    HF_TASK=None,
    SEQ_LEN=SEQ,
    GLOBAL_BATCH=4,
    MESH={"dp": 2, "fsdp": 1},
    data_parallel=2,
)


def test_open_inputs_checks_flags_before_any_collective(tmp_path: Path, capsys) -> None:
    """open_inputs (train.py calls it on the meta model): the synthetic-data notice, and one
    error line and exit 2 for flags and data that do not fit."""
    model = torch.nn.Sequential(torch.nn.Embedding(100, 4), torch.nn.Linear(4, 100))
    model_file = types.SimpleNamespace()
    data, init = rt.open_inputs(PLAN, _args(), model_file, model)
    assert data is None and init is None
    assert capsys.readouterr().err == "data: no --data given, training on synthetic batches\n"
    good = _bin(tmp_path / "train.bin", np.arange(400) % 100)
    data, _ = rt.open_inputs(PLAN, _args(data=str(good)), model_file, model)
    assert len(data.dataset) == 399 // SEQ and capsys.readouterr().err == ""
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01" * 1001)
    cases = [
        (_args(data=str(odd)), "odd count"),
        (_args(data=str(good), eval_every=2), "--eval-every 2 needs --eval-data"),
        (_args(data=str(good), eval_data=str(good)), "--eval-data needs --eval-every"),
        (_args(eval_data=str(good), eval_every=1), "--eval-data needs --data"),
        (_args(data=str(_bin(tmp_path / "big.bin", [100] * 50))), "token id 100, but"),
    ]
    masked = types.SimpleNamespace(**{**vars(PLAN), "HF_TASK": "masked-lm"})
    cases = [(PLAN, *case) for case in cases] + [
        (masked, _args(data=str(good)), "this plan trains a masked LM")
    ]
    for plan, args, match in cases:
        with pytest.raises(SystemExit) as info:
            rt.open_inputs(plan, args, model_file, model)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert match in err, err


# ---- The emitted script under torchrun (gloo) ---------------------------------------------------
TIMEOUT_S = 150
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)
RESUMED = re.compile(r"^checkpoint: resumed from step (\d+)", re.MULTILINE)
BLOCKS = [f"blocks.{i}" for i in range(4)]


def _lines(out: str, key: str) -> dict[int, float]:
    """step -> value of the JSON lines holding ``key``; the last line of a step wins (a resumed
    run logs the steps after its checkpoint again)."""
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    return {r["step"]: r[key] for r in records if key in r}


def _launch(out_dir: Path, *args: str, **env: str) -> tuple[int, str]:
    return run_bounded(["bash", "launch.sh", *args], out_dir, TIMEOUT_S, DIST_TIMEOUT_S="60", **env)


@pytest.fixture(scope="module")
def gpt_dp2(tmp_path_factory) -> dict:
    """examples/gpt.py (vocab 256) planned dp=2 (global batch 8, seq 16), train.bin of 5000
    tokens and val.bin of 1500, and an uninterrupted 6-step run saving every 2 steps."""
    root = tmp_path_factory.mktemp("gpt_dp2")
    rng = np.random.default_rng(0)
    _bin(root / "train.bin", rng.integers(0, 256, 5000))
    _bin(root / "val.bin", rng.integers(0, 256, 1500))
    out_dir = write_outputs(forced_plan(GPT, 2, {"dp": 2}, {}, layers=BLOCKS), root / "out")
    args = ("--steps", "6", "--checkpoint-every", "2", "--data", str(root / "train.bin"))
    rc, out = _launch(out_dir, *args, "--checkpoint-dir", str(root / "ref_ckpt"))
    assert rc == 0, out[-4000:]
    losses = _lines(out, "loss")
    assert list(losses) == list(range(1, 7)), out[-4000:]
    return {"root": root, "out": out_dir, "args": args, "losses": losses}


@pytest.mark.dist
def test_token_file_verifies_and_logs_eval_loss(gpt_dp2) -> None:
    """--verify trains the unsharded model on the whole global batch of the same stream: it
    matches only if the two DP ranks' shares are disjoint and make up that batch."""
    root = gpt_dp2["root"]
    rc, out = _launch(
        gpt_dp2["out"],
        *("--steps", "4", "--verify", "--optimizer", "sgd", "--data", str(root / "train.bin")),
        *("--eval-data", str(root / "val.bin"), "--eval-every", "2"),
    )
    assert rc == 0 and VERIFY_OK.search(out), out[-4000:]
    assert "synthetic" not in out
    evals = _lines(out, "eval_loss")
    assert list(evals) == [2, 4] and all(4.0 < v < 7.0 for v in evals.values()), evals
    assert evals[2] != evals[4]  # the model moved between the two evaluations


# covered by test_resume_keeps_the_saved_data_order (the data position comes back, same losses)
# and test_checkpoint.py::test_fsdp_run_with_a_killed_rank_resumes_bitwise (the kill and restart)
@pytest.mark.slow
@pytest.mark.dist
def test_killed_run_resumes_with_the_same_losses(gpt_dp2, tmp_path: Path) -> None:
    rc, out = _launch(
        gpt_dp2["out"],
        *gpt_dp2["args"],
        *("--checkpoint-dir", str(tmp_path / "ckpt")),
        AUTOPAR_TEST_KILL_AT_STEP="3",
        AUTOPAR_TEST_KILL_RANK="1",
    )
    assert rc == 0, out[-4000:]
    assert RESUMED.findall(out) == ["2"], out[-4000:]
    assert _lines(out, "loss") == gpt_dp2["losses"]


@pytest.mark.dist
def test_resume_keeps_the_saved_data_order(gpt_dp2, tmp_path: Path) -> None:
    """The data seed and position come from the checkpoint: resumed with another --seed, the
    run still reads the samples the uninterrupted one read."""
    import torch.distributed.checkpoint as dcp

    step_4 = gpt_dp2["root"] / "ref_ckpt" / "step_4"
    saved = dcp.FileSystemReader(step_4).read_metadata().state_dict_metadata
    assert {"data.position", "data.seed", "data.num_samples"} <= set(saved)
    shutil.copytree(step_4, tmp_path / "ckpt" / "step_4")
    args = list(gpt_dp2["args"])
    args[1] = "6"
    rc, out = _launch(
        gpt_dp2["out"], *args, "--seed", "7", "--checkpoint-dir", str(tmp_path / "ckpt")
    )
    assert rc == 0 and RESUMED.findall(out) == ["4"], out[-4000:]
    losses = _lines(out, "loss")
    assert losses == {s: gpt_dp2["losses"][s] for s in (5, 6)}


# A model of its own data (make_dataset): each sample's __getitem__ runs in a DataLoader worker
# and notes (rank, index) in a file of that worker process.
OWN_DATA = """
import os
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.lin2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


def build_model():
    return Net()


def make_batch(batch_size, seq_len=None):
    x = torch.randn(batch_size, 4)
    return (x,), x.sum(1, keepdim=True)


class Samples(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(os.path.join(os.environ["TRACE_DIR"], str(os.getpid())), "a") as f:
            f.write(f"{os.environ['RANK']} {i}\\n")
        x = torch.arange(4.0) + i / self.n
        return x, x.sum(0, keepdim=True)


def make_dataset(split):
    return Samples(40 if split == "train" else 16)
"""


@pytest.mark.dist
def test_make_dataset_shares_are_disjoint_over_an_epoch(tmp_path: Path) -> None:
    """5 steps of 8 samples read one epoch of 40: each of the two DP ranks 20 distinct samples
    through its worker processes, the two shares disjoint and together all 40."""
    model_file = tmp_path / "own.py"
    model_file.write_text(OWN_DATA)
    plan = forced_plan(str(model_file), 2, {"dp": 2}, {}, seq_len=None, layers=["lin1", "lin2"])
    out_dir = write_outputs(plan, tmp_path / "out")
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    rc, out = _launch(out_dir, "--steps", "5", "--data-workers", "2", TRACE_DIR=str(trace_dir))
    assert rc == 0, out[-4000:]
    assert "synthetic" not in out
    seen: dict[int, list[int]] = {0: [], 1: []}
    workers = list(trace_dir.iterdir())
    assert len(workers) == 4, workers  # two worker processes per rank
    for path in workers:
        for line in path.read_text().split("\n")[:-1]:
            rank, index = map(int, line.split())
            seen[rank].append(index)
    assert [len(v) for v in seen.values()] == [20, 20]
    assert len(set(seen[0])) == 20 and set(seen[0]).isdisjoint(seen[1])
    assert set(seen[0]) | set(seen[1]) == set(range(40))


@pytest.mark.dist
def test_bad_data_stops_every_rank_with_one_line(gpt_dp2, tmp_path: Path) -> None:
    """Token ids beyond the vocabulary: both ranks stop before any collective, exit 2, and
    rank 0 says why in one line."""
    _bin(tmp_path / "train.bin", [300] * 1000)
    rc, out = _launch(gpt_dp2["out"], "--steps", "1", "--data", str(tmp_path / "train.bin"))
    assert rc != 0, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert "holds token id 300, but the model's vocabulary has 256" in errors[0]
