"""--data: the readers (token files, save_to_disk / parquet / jsonl input_ids), the sample order
(seeded epochs, disjoint data-parallel shares, resumable positions) and the bad-input errors.

Unit tests import the runtime module directly; the torchrun tests run an emitted script on a
.bin token file (kill and resume, DP shares, eval loss).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from autopar.codegen import runtime_data_wip as rt

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
