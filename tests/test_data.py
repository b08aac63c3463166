"""--data: the readers (token files, save_to_disk / parquet / jsonl input_ids), the sample order
(seeded epochs, disjoint data-parallel shares, resumable positions) and the bad-input errors.

Unit tests import the runtime module directly; the torchrun tests run an emitted script on a
.bin token file (kill and resume, DP shares, eval loss).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from _plans import GPT, forced_plan, run_bounded
from autopar.codegen import write_outputs
from autopar.codegen.apply import runtime

rt = runtime()  # the emitted autopar_runtime package, imported as train.py imports it
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
    assert rt.token_range(ds.chunks) == (0, int(tokens.max()))
    signed = [np.array([3, -2, 9], dtype=np.int64), np.array([], dtype=np.int64)]
    assert rt.token_range(signed) == (-2, 9) and rt.token_range([]) == (0, 0)


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


def test_save_to_disk_is_read_by_datasets_or_by_hand(tmp_path: Path, monkeypatch) -> None:
    """datasets.load_from_disk reads a save_to_disk directory where datasets is installed (its
    Arrow files memory mapped); without datasets the Arrow files are read by hand, alike."""
    datasets = pytest.importorskip("datasets")
    rows = [list(range(k, k + 7)) for k in range(5)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "saved")
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"input_ids": rows[:2]}),
        test=datasets.Dataset.from_dict({"input_ids": rows}),
    ).save_to_disk(tmp_path / "dict")
    calls = []
    load = datasets.load_from_disk
    monkeypatch.setattr(
        datasets, "load_from_disk", lambda *a, **k: calls.append(a) or load(*a, **k)
    )
    read = {
        name: [c.tolist() for c in rt.token_chunks(tmp_path / name, "eval")]
        for name in ("saved", "dict")
    }
    assert calls == [(str(tmp_path / "saved"),), (str(tmp_path / "dict" / "test"),)]
    assert [t for c in read["saved"] for t in c] == [t for r in rows for t in r]
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets fails: by hand
    by_hand = {
        name: [c.tolist() for c in rt.token_chunks(tmp_path / name, "eval")]
        for name in ("saved", "dict")
    }
    assert by_hand == read and len(calls) == 2


def _jsonl(path: Path, ids: str) -> Path:
    """A jsonl file whose second row's input_ids is ``ids`` (JSON text)."""
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": ' + ids + "}\n")
    return path


def _saved(root: Path, rows=((1, 2, 3),) * 4, name: str = "saved") -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"input_ids": [list(r) for r in rows]}).save_to_disk(root / name)
    return root / name


def _data_files(saved: Path, *names) -> Path:
    """Point ``saved``'s state.json at ``names``; the path of that state.json."""
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"] = [{"filename": n} for n in names]
    (saved / "state.json").write_text(json.dumps(state))
    return saved / "state.json"


def _parquet(path: Path, column) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": column}), path)
    return path


def _bad_data(case: str, tmp: Path, monkeypatch) -> tuple[Path, Path]:
    """The --data path of ``case`` and the file its error line must name."""
    path = tmp / "train.bin"
    if case == "odd":
        path.write_bytes(b"\x01\x00\x02")
    elif case == "short":
        _bin(path, range(SEQ))
    elif case == "vocab":
        _bin(path, [1, 2, 500] * 10)
    elif case == "empty_bin":
        path.touch()
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads a chmod 000 file: read_error covers the same line")
        _bin(path, range(100)).chmod(0)
    elif case == "read_error":  # what an unreadable file raises, whoever runs the test
        _bin(path, range(100))

        def denied(name, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(name))

        monkeypatch.setattr(np, "memmap", denied)
    elif case == "npy_float":
        path = tmp / "t.npy"
        np.save(path, np.zeros(100, dtype=np.float32))
    elif case == "npz":
        path = tmp / "t.npy"
        with open(path, "wb") as f:
            np.savez(f, tokens=np.zeros(100, dtype=np.uint16))
    elif case == "npy_garbage":
        path = tmp / "t.npy"
        path.write_bytes(b"\x93NUMPY garbage" * 10)
    elif case == "suffix":
        path = tmp / "t.txt"
        path.write_text("hello")
    elif case == "jsonl_field":
        path = tmp / "t.jsonl"
        path.write_text('{"ids": [1, 2]}\n')
    elif case == "jsonl_not_json":
        path = _jsonl(tmp / "t.jsonl", "[1, 2")
    elif case == "jsonl_not_utf8":
        path = tmp / "t.jsonl"
        path.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [3], "text": "\xff\xfe"}\n')
    elif case.startswith("jsonl_"):
        ids = {
            "float": "[1, 2.0, 3]",
            "bool": "[1, true]",
            "negative": "[5, -1]",
            "string": '["7"]',
            "null_id": "[1, null]",
            "null": "null",
            "scalar": "5",
            "ragged": "[[1, 2], [3]]",
            "object": '[{"id": 1}]',
            "int64": "[9223372036854775808]",
        }[case[len("jsonl_") :]]
        path = _jsonl(tmp / "t.jsonl", ids)
    elif case in ("no_column", "parquet_garbage", "arrow_garbage") or case.startswith("dir_"):
        (tmp / "d").mkdir()
        path = tmp / "d" / "a.parquet"  # a directory of table files, one of them bad
        _parquet(tmp / "d" / "0.parquet", [[1, 2, 3]] * 10)
        if case == "no_column":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": ["a", "b"]}), path)
        elif case == "parquet_garbage":
            path.write_bytes(os.urandom(300))
        elif case == "arrow_garbage":
            path = path.with_suffix(".arrow")
            path.write_bytes(os.urandom(300))
        elif case == "dir_fifo":
            path = path.with_suffix(".jsonl")
            os.mkfifo(path)
        elif case == "dir_directory":
            path.mkdir()
        elif case == "dir_dangling":
            path.symlink_to(tmp / "gone.parquet")
        return tmp / "d", path
    elif case.startswith("parquet_"):
        pa = pytest.importorskip("pyarrow")
        column = {
            "negative": [[1, 2], [3, -5]],
            "float": [[1.0, 2.0]],
            "scalar": [1, 2, 3],
            "nested": [[[1, 2], [3]]],
            "null": [[1, None], [2]],
            "null_row": [[1, 2], None],
            "uint64": pa.array([[1, 2**64 - 1]], pa.list_(pa.uint64())),
        }[case[len("parquet_") :]]
        path = _parquet(tmp / "t.parquet", column)
    elif case.startswith("saved_"):
        saved = _saved(tmp)
        (arrow,) = saved.glob("data-*.arrow")
        if case in ("saved_garbage", "saved_garbage_by_hand"):
            arrow.write_bytes(os.urandom(300))
            if case.endswith("by_hand"):
                monkeypatch.setitem(sys.modules, "datasets", None)
            return saved, saved
        if case == "saved_float":
            return _saved(tmp, rows=[(1.0, 2.0)] * 4, name="floats"), tmp / "floats"
        if case == "saved_fifo":
            arrow.unlink()
            os.mkfifo(arrow)
            return saved, arrow
        if case == "saved_dict":
            (saved / "dataset_dict.json").write_text('{"splits": "train"}')
            return saved, saved / "dataset_dict.json"
        if case == "saved_split_link":
            (tmp / "dict").mkdir()
            (tmp / "dict" / "dataset_dict.json").write_text('{"splits": ["train"]}')
            (tmp / "dict" / "train").symlink_to(saved)
            return tmp / "dict", tmp / "dict" / "dataset_dict.json"
        state = saved / "state.json"
        if case == "saved_not_json":
            state.write_text('{"_data_files": [')
        elif case == "saved_types":
            state.write_text('{"_data_files": "data.arrow"}')
        elif case == "saved_name":
            _data_files(saved, 7)
        else:  # a data file outside the dataset: ../, absolute, a symlink out
            outside = shutil.copy(arrow, tmp / "outside.arrow")
            (saved / "link.arrow").symlink_to(outside)
            name = {"saved_parent": "../outside.arrow", "saved_absolute": str(outside)}
            _data_files(saved, name.get(case, "link.arrow"))
        return saved, state
    return path, path


BAD_DATA = [
    ("missing", "does not exist"),
    ("odd", "odd count"),
    ("short", "fewer than one window"),
    ("vocab", "token id 500, but the model's vocabulary has 100"),
    ("empty_bin", r"is empty \(0 bytes\)"),
    ("fifo", r"is a FIFO \(named pipe\), not a regular file"),
    ("unreadable", r"cannot read .* \(Permission denied\)"),
    ("read_error", r"cannot read .* \(Permission denied\): check the file"),
    ("npy_float", "1-D uint16 or uint32"),
    ("npz", "is an .npz archive, not a .npy array"),
    ("npy_garbage", "is not a .npy array"),
    ("suffix", "unknown data format"),
    ("jsonl_field", "line 1 has no input_ids field"),
    ("jsonl_not_json", "line 2 is not JSON"),
    ("jsonl_not_utf8", "is not UTF-8 text"),
    ("jsonl_float", r"line 2: input_ids\[1\] is 2.0, a float: input_ids must be a flat list"),
    ("jsonl_bool", r"line 2: input_ids\[1\] is true, a boolean"),
    ("jsonl_negative", r"line 2: input_ids\[1\] is -1, negative"),
    ("jsonl_string", r'line 2: input_ids\[0\] is "7", a string'),
    ("jsonl_null_id", r"line 2: input_ids\[1\] is null"),
    ("jsonl_null", "line 2: input_ids is null"),
    ("jsonl_scalar", "line 2: input_ids is 5, not a list"),
    ("jsonl_ragged", r"line 2: input_ids\[0\] is \[1, 2\], a list"),
    ("jsonl_object", r'line 2: input_ids\[0\] is \{"id": 1\}, an object'),
    ("jsonl_int64", r"line 2: input_ids\[0\] is 9223372036854775808, beyond int64"),
    ("no_column", "no input_ids column"),
    ("parquet_garbage", "is not a readable parquet file"),
    ("arrow_garbage", "is not a readable Arrow IPC file"),
    ("dir_fifo", r"is a FIFO \(named pipe\), not a regular file"),
    ("dir_directory", "is a directory, not a regular file"),
    ("dir_dangling", "is a symlink to .*gone.parquet, which does not exist"),
    ("parquet_negative", "holds token id -5: token ids are >= 0"),
    ("parquet_float", r"input_ids is a column of list<\w+: double>, not of lists of integer"),
    ("parquet_scalar", "input_ids is a column of int64, not of lists"),
    ("parquet_nested", r"input_ids is a column of list<\w+: list<\w+: int64>>"),
    ("parquet_null", r"input_ids holds nulls \(0 null rows, 1 null ids\)"),
    ("parquet_null_row", r"input_ids holds nulls \(1 null rows, 0 null ids\)"),
    ("parquet_uint64", "holds token id 18446744073709551615, beyond int64"),
    ("saved_not_json", "state.json is not JSON"),
    ("saved_types", 'state.json has no list of "_data_files"'),
    ("saved_name", "names the data file 7, not a file name"),
    ("saved_parent", "names the data file '../outside.arrow' outside"),
    ("saved_absolute", "names the data file '/.*outside.arrow' outside"),
    ("saved_link", "names the data file 'link.arrow' outside"),
    ("saved_dict", 'dataset_dict.json has no list of "splits"'),
    ("saved_split_link", "names the split 'train' outside"),
    ("saved_fifo", r"is a FIFO \(named pipe\), not a regular file"),
    ("saved_garbage", "datasets.load_from_disk cannot read"),
    ("saved_garbage_by_hand", "is not a readable Arrow IPC file"),
    ("saved_float", r"input_ids is a column of list<\w+: double>"),
]


def _no_hang(signum, frame):
    raise TimeoutError("the data reader blocked (it opened a FIFO?)")


@pytest.mark.bad_input
@pytest.mark.parametrize("case, match", BAD_DATA, ids=[c for c, _ in BAD_DATA])
def test_bad_data_is_one_input_error(tmp_path: Path, monkeypatch, case: str, match: str) -> None:
    """Each bad --data input is one InputError line naming the file, before any training: the
    path given, or the file inside it that breaks the rule."""
    path, named = _bad_data(case, tmp_path, monkeypatch)
    vocab = None if case == "parquet_uint64" else 100
    before = signal.signal(signal.SIGALRM, _no_hang)
    signal.alarm(60)  # a reader that opens a FIFO blocks: fail instead
    try:
        with pytest.raises(rt.InputError, match=match) as info:
            rt.open_dataset(path, SEQ, vocab_size=vocab)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert "\n" not in str(info.value) and str(named) in str(info.value), str(info.value)


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
    few = _bin(tmp_path / "few.bin", np.arange(3 * SEQ + 1))  # 3 windows, a global batch is 4
    few_batches = "holds 3 samples (25 tokens, windows of 9), fewer than one global batch of 4"
    cases = [
        (_args(data=str(odd)), "odd count"),
        (_args(data=str(few)), f"--data {few} {few_batches}: give more data"),
        (_args(data=str(good), eval_data=str(few), eval_every=1), f"--eval-data {few} holds 3"),
        (_args(data=str(good), eval_every=2), "--eval-every 2 needs --eval-data"),
        (_args(data=str(good), eval_data=str(good)), "--eval-data needs --eval-every"),
        (_args(eval_data=str(good), eval_every=1), "--eval-data needs --data"),
        (_args(data=str(_bin(tmp_path / "big.bin", [100] * 50))), "token id 100, but"),
    ]
    masked = types.SimpleNamespace(**{**vars(PLAN), "HF_TASK": "masked-lm"})
    own = types.SimpleNamespace(make_dataset=lambda split: [(torch.zeros(2), torch.zeros(2))] * 3)
    cases = [(PLAN, args, match, model_file) for args, match in cases] + [
        (masked, _args(data=str(good)), "this plan trains a masked LM", model_file),
        (PLAN, _args(), "make_dataset('train') holds 3 samples, fewer than one global batch", own),
    ]
    for plan, args, match, module in cases:
        with pytest.raises(SystemExit) as info:
            rt.open_inputs(plan, args, module, model)
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
    rank 0 says why in one line naming the file, no traceback (test_bad_data_is_one_input_error
    has the other bad inputs, each one such line)."""
    bad = _bin(tmp_path / "train.bin", [300] * 1000)
    rc, out = _launch(gpt_dp2["out"], "--steps", "1", "--data", str(bad))
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert f"{bad} holds token id 300, but the model's vocabulary has 256" in errors[0]
