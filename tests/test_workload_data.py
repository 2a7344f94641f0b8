"""Data: the sample generator, validation errors, the token cache and the batch samplers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.workload_support import (
    REPO,
    TINY,
    error_lines,
    make_data,
    no_xla_side_effects,
    run_train,
    single_thread,
)
from workload import token_cache
from workload.batches import EvalBatches, TrainBatches
from workload.data import DataError, find_split_files, read_split, read_splits, resolve_data_dir
from workload.token_cache import TokenizedSplit, cache_key, split_cache_dir, write_token_cache

pytestmark = pytest.mark.usefixtures(single_thread.__name__)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from workload.model import train_tiny_tokenizer

    directory = make_data(tmp_path_factory.mktemp("tok-data"), train=200, test=20)
    raw = read_split(find_split_files(directory, "train"), "classification")
    with no_xla_side_effects():
        return train_tiny_tokenizer(raw.texts(), "classification", 500)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


GOOD = {"label": 1, "title": "Great", "content": "It works."}


# -- the sample generator -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_sample_data_reads_back_the_same_in_every_format(tmp_path: Path, fmt: str) -> None:
    reference = read_splits(make_data(tmp_path / "jsonl", train=50, test=10), "classification")
    other = read_splits(make_data(tmp_path / fmt, train=50, test=10, fmt=fmt), "classification")
    for split in ("train", "test"):
        assert other[split].labels == reference[split].labels
        assert other[split].titles == reference[split].titles
        assert other[split].contents == reference[split].contents


def test_sample_data_is_deterministic_balanced_and_not_trivial(tmp_path: Path) -> None:
    first = (make_data(tmp_path / "a", train=400, test=10) / "train.jsonl").read_text()
    assert first == (make_data(tmp_path / "b", train=400, test=10) / "train.jsonl").read_text()
    assert (
        first != (make_data(tmp_path / "c", train=400, test=10, seed=1) / "train.jsonl").read_text()
    )
    rows = [json.loads(line) for line in first.splitlines()]
    counts = Counter(row["label"] for row in rows)
    assert 150 < counts[1] < 250
    negated = [r for r in rows if " not " in r["content"] or " never " in r["content"]]
    assert len(negated) > 40  # negations are common enough that word counting is not enough
    misleading = sum(
        1
        for r in rows
        if any(w.lower() in r["title"].lower() for w in ("terrible", "awful", "poor"))
        and r["label"] == 1
    )
    assert misleading > 0  # some titles disagree with the label
    test_rows = (tmp_path / "a" / "test.jsonl").read_text().splitlines()
    assert not set(test_rows) & set(first.splitlines())


def test_sample_data_script_refuses_bad_sizes(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_sample_data.py"), "--output",
         str(tmp_path), "--train-size", "0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--train-size must be at least 1" in result.stderr


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"label": 1, "title": "x"}] * 2, "missing column 'content'; the columns must include"),
        ([GOOD, {"label": 1, "title": "x"}], "row 2: no content"),
        ([GOOD, {**GOOD, "title": 5}], "row 2: title is 5; it must be text"),
        (
            [GOOD, GOOD, {**GOOD, "label": 2}],
            "row 3: label is 2; allowed: 0 (negative), 1 (positive)",
        ),
        ([GOOD, {**GOOD, "label": "positive"}], "row 2: label is 'positive'"),
        ([GOOD, {**GOOD, "title": "", "content": "   "}], "row 2: empty text"),
        ([GOOD, {**GOOD, "content": None}], "row 2: content is null"),
        ([GOOD, {**GOOD, "label": 1.5}], "row 2: label is 1.5"),
    ],
)
def test_bad_rows_name_the_file_the_row_and_the_reason(
    tmp_path: Path, rows: list[dict[str, Any]], message: str
) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as caught:
        read_split([path], "classification")
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_causal_lm_needs_no_label(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [{"title": "a", "content": "b"}])
    assert read_split([path], "causal-lm").labels is None
    with pytest.raises(DataError, match="missing column 'label'"):
        read_split([path], "classification")


def test_labels_as_text_in_csv_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text('label,title,content\n1,Good,"Works, well."\n0,,Broke\n')
    raw = read_split([path], "classification")
    assert raw.labels == [1, 0]
    assert raw.contents == ["Works, well.", "Broke"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("train.parquet", b"PAR1 this is not parquet", "not a readable parquet file"),
        ("train.jsonl", b'{"label": 1, "title": "a", "content": "b"}\n{"label": 1,\n',
         "row 2: not valid JSON"),
        ("train.jsonl", b'[1, "a", "b"]\n', "row 1: not a JSON object"),
        ("train.jsonl", b'{"label": 1, "title": "\xff", "content": "b"}\n', "not UTF-8 text"),
        ("train.jsonl", b"\n", "has no rows"),
        ("train.csv", b"label,title,content\n1,a,b\n1,a,b,c,d\n",
         "row 2: 5 fields where the header has 3"),
    ],
)  # fmt: skip
def test_unreadable_files(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_split([tmp_path / name], "classification")


def test_finding_splits(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no train split: expected train\.parquet, train\.jsonl"):
        find_split_files(tmp_path, "train")
    _write_jsonl(tmp_path / "train.jsonl", [GOOD])
    (tmp_path / "train.csv").write_text("label,title,content\n1,a,b\n")
    with pytest.raises(DataError, match="several formats"):
        find_split_files(tmp_path, "train")
    # Hugging Face dataset repositories keep sharded parquet one folder down.
    shards = tmp_path / "hub"
    (shards / "plain_text").mkdir(parents=True)
    make_data(tmp_path / "gen", train=30, test=10, fmt="parquet")
    for index in range(2):
        (shards / "plain_text" / f"train-0000{index}-of-00002.parquet").write_bytes(
            (tmp_path / "gen" / "train.parquet").read_bytes()
        )
    files = find_split_files(shards, "train")
    assert [f.name for f in files] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert len(read_split(files, "classification")) == 60


def test_data_argument(tmp_path: Path) -> None:
    assert resolve_data_dir(str(tmp_path), tmp_path / "hub", allow_download=False) == tmp_path
    (tmp_path / "file.jsonl").write_text("")
    with pytest.raises(DataError, match="is a file"):
        resolve_data_dir(str(tmp_path / "file.jsonl"), tmp_path / "hub", allow_download=False)
    with pytest.raises(DataError, match="no such directory"):
        resolve_data_dir(str(tmp_path / "missing"), tmp_path / "hub", allow_download=False)
    with pytest.raises(DataError, match="hub dataset could not be fetched"):
        resolve_data_dir("someone/no-such-dataset", tmp_path / "hub", allow_download=False)


# -- the token cache ------------------------------------------------------------------------


def test_token_cache_is_fixed_shape_and_memory_mapped(tmp_path: Path, tokenizer: Any) -> None:
    directory = make_data(tmp_path / "d", train=40, test=8)
    files = find_split_files(directory, "train")
    raw = read_split(files, "classification")
    target = split_cache_dir(
        tmp_path / "cache", "train", cache_key(files, tokenizer, "classification", 32)
    )
    write_token_cache(raw, tokenizer, "classification", 32, target)
    assert sorted(p.name for p in target.iterdir()) == [
        "input_ids.npy", "labels.npy", "lengths.npy", "meta.json", "token_type_ids.npy",
    ]  # fmt: skip
    assert np.load(target / "input_ids.npy", mmap_mode="r").shape == (40, 32)
    split = TokenizedSplit(target, "classification")
    batch = split[[3, 0, -1]]
    assert batch["input_ids"].shape == (3, 32)
    assert batch["weight"].tolist() == [1.0, 1.0, 0.0]
    assert batch["labels"].tolist()[:2] == [raw.labels[3], raw.labels[0]]  # type: ignore[index]
    assert (batch["input_ids"][2] == batch["input_ids"][1]).all()  # padding row = row 0
    first = tokenizer(raw.titles[3], raw.contents[3], truncation=True, max_length=32)
    n = len(first["input_ids"])
    assert batch["input_ids"][0, :n].tolist() == first["input_ids"]
    assert batch["attention_mask"][0].sum().item() == n


def test_a_split_travels_to_loader_workers_without_its_arrays(
    tmp_path: Path, tokenizer: Any
) -> None:
    import pickle

    directory = make_data(tmp_path / "d", train=30, test=5)
    files = find_split_files(directory, "train")
    target = write_token_cache(
        read_split(files, "classification"), tokenizer, "classification", 32, tmp_path / "c"
    )
    split = TokenizedSplit(target, "classification")
    expected = split[[1, 2]]
    copy = pickle.loads(pickle.dumps(split))
    assert len(pickle.dumps(split)) < 2000  # the memory maps are reopened, not copied
    assert all(torch.equal(copy[[1, 2]][k], v) for k, v in expected.items())


def test_cache_key_follows_the_inputs(tmp_path: Path, tokenizer: Any) -> None:
    files = find_split_files(make_data(tmp_path, train=10, test=5), "train")
    key = cache_key(files, tokenizer, "classification", 32)
    assert key == cache_key(files, tokenizer, "classification", 32)
    assert key != cache_key(files, tokenizer, "classification", 64)
    assert key != cache_key(files, tokenizer, "causal-lm", 32)
    files[0].write_text(files[0].read_text() + json.dumps(GOOD) + "\n")
    assert key != cache_key(files, tokenizer, "classification", 32)


def test_a_failed_cache_write_leaves_nothing(
    tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = make_data(tmp_path / "d", train=10, test=5)
    raw = read_split(find_split_files(directory, "train"), "classification")

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_cache.np, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_token_cache(raw, tokenizer, "classification", 32, tmp_path / "cache" / "train-x")
    assert list((tmp_path / "cache").iterdir()) == []


# -- batches --------------------------------------------------------------------------------


def test_training_batches_shard_the_data_and_drop_the_tail() -> None:
    world, batch = 3, 4
    ranks = [TrainBatches(50, batch, rank, world, seed=7) for rank in range(world)]
    assert ranks[0].steps_per_epoch == 4  # 50 // 12, the last 2 examples dropped
    epoch = [list(r) for r in ranks]
    seen = [i for rank in epoch for b in rank for i in b]
    assert len(seen) == len(set(seen)) == 48
    assert all(len(b) == batch for rank in epoch for b in rank)
    ranks[0].set_position(1, 0)
    assert list(ranks[0]) != epoch[0]  # a new shuffle each epoch


def test_training_batches_resume_mid_epoch() -> None:
    full = list(TrainBatches(100, 5, 1, 2, seed=3).__iter__())
    resumed = TrainBatches(100, 5, 1, 2, seed=3)
    resumed.set_position(0, 4)
    assert list(resumed) == full[4:]
    assert len(resumed) == len(full) - 4


def test_too_little_data_for_one_step() -> None:
    with pytest.raises(DataError, match="fewer than one step takes"):
        TrainBatches(7, 4, 0, 2, seed=0)


@pytest.mark.parametrize(
    ("examples", "world", "batch"), [(10, 2, 4), (16, 2, 4), (3, 4, 2), (1, 1, 8)]
)
def test_evaluation_batches_cover_every_example_once(examples: int, world: int, batch: int) -> None:
    ranks = [list(EvalBatches(examples, batch, rank, world)) for rank in range(world)]
    assert len({len(r) for r in ranks}) == 1  # every rank runs the same number of batches
    assert all(len(b) == batch for r in ranks for b in r)
    real = sorted(i for r in ranks for b in r for i in b if i >= 0)
    assert real == list(range(examples))


def test_bad_data_stops_the_job_before_anything_is_written(tmp_path: Path) -> None:
    directory = make_data(tmp_path / "data", train=64, test=16)
    lines = (directory / "test.jsonl").read_text().splitlines()
    lines[6] = json.dumps({"label": 3, "title": "Odd", "content": "A third kind of review."})
    (directory / "test.jsonl").write_text("\n".join(lines) + "\n")
    output = tmp_path / "job"
    result = run_train(
        ["--data", str(directory), "--output", str(output), "--device", "cpu", *TINY], timeout=300
    )
    # The job's own input is wrong: status 2, which the cluster's supervisor does not retry
    # (workload/turns.py exit_status); before, 1, and every retry was spent on it.
    assert result.returncode == 2, result.stderr[-2000:]
    assert error_lines(result.stderr) == [
        f"train.py: error: {directory / 'test.jsonl'}: row 7: label is 3; "
        "allowed: 0 (negative), 1 (positive)"
    ]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in output.iterdir()) == []
    assert not (directory / ".token-cache").exists()


def test_missing_data_is_the_input_error_2_on_every_rank(tmp_path: Path) -> None:
    """--data that does not exist, under torchrun with two ranks: rank 0 finds it and every
    rank exits 2 (the error shared with its status, workload/turns.py), so torchrun's report
    names 2 whichever rank it sees first, and launch.sh reports the input error."""
    missing = tmp_path / "no-such-data"
    result = run_train(
        ["--data", str(missing), "--output", str(tmp_path / "job"), "--device", "cpu", *TINY],
        nproc=2, timeout=600,
    )  # fmt: skip
    assert result.returncode != 0
    assert "exitcode  : 2 (pid:" in result.stderr, result.stderr[-3000:]
    assert "exitcode  : 1 (pid:" not in result.stderr
    assert error_lines(result.stderr) == [f"train.py: error: --data {missing}: no such directory"]
