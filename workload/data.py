"""The data: read and validate the splits, tokenize once into a memory-mapped cache, batch.

Layout (as Amazon Polarity ships it): a directory with ``train.<ext>`` and ``test.<ext>``
(or shards ``train-*.<ext>``, also one folder down as in Hugging Face dataset repos), where
``<ext>`` is parquet, jsonl or csv, and the columns are ``label`` (0 negative, 1 positive),
``title`` and ``content``. A Hugging Face dataset name is downloaded into that layout first.

Every problem in the input (missing file or column, unreadable file, empty text, label
outside {0, 1}) raises ``DataError`` naming the file, the row and the reason, before any
cache is written. Token IDs are stored as fixed-shape ``.npy`` arrays, written to a
temporary directory and renamed into place, so a cache is either complete or absent.
Training reads them memory-mapped: a rank touches only the rows of its own shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
FORMATS = ("parquet", "jsonl", "csv")
LABELS = (0, 1)
CACHE_VERSION = 1
TOKENIZE_BATCH = 4096

#: Columns each task reads.
COLUMNS = {"classification": ("label", "title", "content"), "causal-lm": ("title", "content")}

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class DataError(ValueError):
    """Unusable input data; the message names the file, the row and the reason."""


# -- finding and reading the splits ------------------------------------------------------------


def find_split_files(data_dir: Path, split: str) -> list[Path]:
    """The file (or sorted shards) holding ``split`` in ``data_dir``, in one format."""
    found: dict[str, list[Path]] = {}
    for fmt in FORMATS:
        for pattern in (
            f"{split}.{fmt}",
            f"{split}-*.{fmt}",
            f"*/{split}.{fmt}",
            f"*/{split}-*.{fmt}",
        ):
            matches = sorted(p for p in data_dir.glob(pattern) if p.is_file())
            matches = [
                p
                for p in matches
                if not any(part.startswith(".") for part in p.relative_to(data_dir).parts)
            ]
            if matches:
                found.setdefault(fmt, []).extend(m for m in matches if m not in found.get(fmt, []))
    if not found:
        raise DataError(
            f"{data_dir}: no {split} split: expected {split}.parquet, {split}.jsonl or "
            f"{split}.csv (or shards {split}-*.<ext>)"
        )
    if len(found) > 1:
        names = ", ".join(found[fmt][0].name for fmt in found)
        raise DataError(f"{data_dir}: the {split} split is in several formats ({names}); keep one")
    return next(iter(found.values()))


@dataclass(frozen=True)
class RawSplit:
    """The validated text and labels of one split."""

    titles: list[str]
    contents: list[str]
    labels: list[int] | None
    files: tuple[Path, ...]

    def __len__(self) -> int:
        return len(self.contents)

    def texts(self) -> Iterator[str]:
        for title, content in zip(self.titles, self.contents, strict=True):
            yield f"{title}\n{content}" if title else content


_MISSING = object()


def _read_columns(path: Path, wanted: Sequence[str]) -> tuple[dict[str, list[Any]], list[str]]:
    """The ``wanted`` columns of the file (``_MISSING`` where a row lacks one) and the
    names of all its columns, or DataError saying where and why it cannot be read.

    JSONL and CSV are read line by line in Python so that an error names its row; Parquet
    is typed and read with pyarrow.
    """
    fmt = path.suffix.lstrip(".")
    try:
        if fmt == "parquet":
            return _read_parquet(path, wanted)
        with path.open(encoding="utf-8", newline="") as handle:
            if fmt == "jsonl":
                return _read_jsonl(path, handle, wanted)
            return _read_csv(path, handle, wanted)
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _read_parquet(path: Path, wanted: Sequence[str]) -> tuple[dict[str, list[Any]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, ValueError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise DataError(f"{path}: not a readable parquet file ({first})") from None
    names = list(table.column_names)
    return {c: table.column(c).to_pylist() for c in wanted if c in names}, names


def _read_jsonl(
    path: Path, handle: Any, wanted: Sequence[str]
) -> tuple[dict[str, list[Any]], list[str]]:
    columns: dict[str, list[Any]] = {c: [] for c in wanted}
    names: dict[str, None] = {}
    row = 0
    for line in handle:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _row_error(path, row, f"not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise _row_error(path, row, "not a JSON object")
        names.update(dict.fromkeys(record))
        for column, values in columns.items():
            values.append(record.get(column, _MISSING))
        row += 1
    return columns, list(names)


def _read_csv(
    path: Path, handle: Any, wanted: Sequence[str]
) -> tuple[dict[str, list[Any]], list[str]]:
    import csv

    reader = csv.reader(handle)
    try:
        header = next(reader, [])
        index = {name: i for i, name in enumerate(header)}
        columns: dict[str, list[Any]] = {c: [] for c in wanted if c in index}
        for row, fields in enumerate(reader):
            if len(fields) != len(header):
                raise _row_error(
                    path, row, f"{len(fields)} fields where the header has {len(header)}"
                )
            for column, values in columns.items():
                values.append(fields[index[column]])
    except csv.Error as exc:
        raise DataError(f"{path}: line {reader.line_num}: not valid CSV ({exc})") from None
    return columns, header


def _row_error(path: Path, index: int, reason: str) -> DataError:
    return DataError(f"{path}: row {index + 1}: {reason}")


def _check_label(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value in LABELS else None
    if isinstance(value, float) and value.is_integer():
        return int(value) if int(value) in LABELS else None
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value.strip())
    return None


def read_file(path: Path, task: str) -> RawSplit:
    """Read and validate one file: required columns, text present, labels in {0, 1}."""
    required = COLUMNS[task]
    columns, names = _read_columns(path, required)
    if not any(columns.values()):
        raise DataError(f"{path}: has no rows")
    missing = [c for c in required if c not in names]
    if missing:
        raise DataError(
            f"{path}: missing column {', '.join(repr(c) for c in missing)}; "
            f"the columns must include {', '.join(required)} (found: "
            f"{', '.join(names) or 'none'})"
        )
    titles, contents = columns["title"], columns["content"]
    for index, (title, content) in enumerate(zip(titles, contents, strict=True)):
        for name, value in (("title", title), ("content", content)):
            if value is _MISSING:
                raise _row_error(path, index, f"no {name}")
            if value is None:
                raise _row_error(path, index, f"{name} is null; it must be text")
            if not isinstance(value, str):
                raise _row_error(path, index, f"{name} is {value!r}; it must be text")
        if not title.strip() and not content.strip():
            raise _row_error(path, index, "empty text: title and content are both empty")
    labels: list[int] | None = None
    if "label" in required:
        labels = []
        for index, value in enumerate(columns["label"]):
            if value is _MISSING:
                raise _row_error(path, index, "no label")
            label = _check_label(value)
            if label is None:
                raise _row_error(
                    path, index, f"label is {value!r}; allowed: 0 (negative), 1 (positive)"
                )
            labels.append(label)
    return RawSplit(
        titles=[t.strip() for t in titles],
        contents=[c.strip() for c in contents],
        labels=labels,
        files=(path,),
    )


_READ: dict[tuple[Any, ...], RawSplit] = {}


def read_split(files: Sequence[Path], task: str) -> RawSplit:
    """Read and validate every file of a split (shards in order).

    Remembered per (files, sizes, mtimes) until ``forget_reads()``: rank 0 reads the text
    once to train a tokenizer and once more to fill the token cache.
    """
    try:
        key = (task, tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    except OSError as exc:
        raise DataError(f"{exc.filename}: cannot read it ({exc.strerror})") from None
    if key in _READ:
        return _READ[key]
    parts = [read_file(path, task) for path in files]
    if len(parts) == 1:
        result = parts[0]
    else:
        labels = None if parts[0].labels is None else [y for p in parts for y in p.labels or []]
        result = RawSplit(
            titles=[t for p in parts for t in p.titles],
            contents=[c for p in parts for c in p.contents],
            labels=labels,
            files=tuple(files),
        )
    _READ[key] = result
    return result


def forget_reads() -> None:
    """Drop the remembered splits (their text is no longer needed once cached)."""
    _READ.clear()


def read_splits(data_dir: Path, task: str) -> dict[str, RawSplit]:
    """Both splits, fully validated (so an error in ``test`` stops the job before training)."""
    return {split: read_split(find_split_files(data_dir, split), task) for split in SPLITS}


def resolve_data_dir(data: str, download_dir: Path, *, allow_download: bool) -> Path:
    """``--data`` as a local directory; a hub dataset name is downloaded (parquet) first."""
    path = Path(data).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise DataError(
            f"--data {data}: is a file; give the directory that holds train.* and test.*"
        )
    if not _HUB_NAME.match(data) or data.startswith((".", "/")):
        raise DataError(f"--data {data}: no such directory")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=data,
            repo_type="dataset",
            allow_patterns=[f"*{split}*.parquet" for split in SPLITS]
            + [f"*/*{split}*.parquet" for split in SPLITS],
            cache_dir=str(download_dir),
            local_files_only=not allow_download,
        )
    except Exception as exc:  # any hub or network failure becomes one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"--data {data}: not a local directory, and the Hugging Face hub dataset could "
            f"not be fetched ({first})"
        ) from None
    return Path(local)


# -- the token cache -------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's full definition (vocabulary, normalizer, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def cache_key(files: Sequence[Path], tokenizer: Any, task: str, max_length: int) -> str:
    identity = {
        "version": CACHE_VERSION,
        "task": task,
        "max_length": max_length,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def choose_cache_root(data_dir: Path, cache_dir: str, output: Path) -> Path:
    """``--cache-dir``, else ``<data>/.token-cache`` if writable, else ``<output>/token-cache``."""
    candidates = [Path(cache_dir)] if cache_dir else [data_dir / ".token-cache"]
    candidates.append(output / "token-cache")
    for root in candidates:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
            return root
        except OSError:
            log.info("token cache: %s is not writable", root)
    raise DataError(
        f"no writable directory for the token cache (tried {', '.join(map(str, candidates))})"
    )


def split_cache_dir(cache_root: Path, split: str, key: str) -> Path:
    return cache_root / f"{split}-{key}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_token_cache(
    raw: RawSplit, tokenizer: Any, task: str, max_length: int, target: Path
) -> Path:
    """Tokenize ``raw`` in batches into fixed-shape arrays at ``target``, atomically."""
    if target.is_dir():
        return target
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        n = len(raw)
        ids = np.lib.format.open_memmap(
            tmp / "input_ids.npy", mode="w+", dtype=np.int32, shape=(n, max_length)
        )
        lengths = np.zeros(n, dtype=np.int32)
        type_ids = None
        for start in range(0, n, TOKENIZE_BATCH):
            stop = min(start + TOKENIZE_BATCH, n)
            if task == "classification":
                enc = tokenizer(
                    raw.titles[start:stop],
                    raw.contents[start:stop],
                    truncation="longest_first",
                    max_length=max_length,
                    padding="max_length",
                )
            else:
                enc = tokenizer(
                    list(_islice(raw.texts(), start, stop)),
                    truncation=True,
                    max_length=max_length,
                    padding="max_length",
                )
            ids[start:stop] = np.asarray(enc["input_ids"], dtype=np.int32)
            lengths[start:stop] = np.asarray(enc["attention_mask"], dtype=np.int32).sum(axis=1)
            if "token_type_ids" in enc and task == "classification":
                if type_ids is None:
                    type_ids = np.lib.format.open_memmap(
                        tmp / "token_type_ids.npy", mode="w+", dtype=np.int8, shape=(n, max_length)
                    )
                type_ids[start:stop] = np.asarray(enc["token_type_ids"], dtype=np.int8)
        ids.flush()
        del ids
        if type_ids is not None:
            type_ids.flush()
            del type_ids
        np.save(tmp / "lengths.npy", lengths)
        if raw.labels is not None:
            np.save(tmp / "labels.npy", np.asarray(raw.labels, dtype=np.int64))
        meta = {
            "version": CACHE_VERSION,
            "examples": n,
            "max_length": max_length,
            "task": task,
            "files": [str(p) for p in raw.files],
            "truncated": int((lengths >= max_length).sum()),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for child in tmp.iterdir():
            _fsync(child)
        _fsync(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not a lost race with another node writing the same cache
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("token cache: wrote %s (%d examples, %d truncated)", target, n, meta["truncated"])
    return target


def _islice(items: Iterator[str], start: int, stop: int) -> Iterator[str]:
    import itertools

    return itertools.islice(items, start, stop)


class TokenizedSplit:
    """A split in the token cache; ``split[indices]`` is a batch of tensors.

    Index ``-1`` is a padding row (a copy of row 0 with ``weight`` 0). The arrays are opened
    memory-mapped on first use in each process, so the object is cheap to send to
    data-loader workers.
    """

    def __init__(self, directory: Path, task: str):
        self.directory = directory
        self.task = task
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        self.examples = int(meta["examples"])
        self.max_length = int(meta["max_length"])
        self._arrays: dict[str, np.ndarray] | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.examples

    def _open(self) -> dict[str, np.ndarray]:
        if self._arrays is None or self._pid != os.getpid():
            arrays = {}
            for name in ("input_ids", "lengths", "labels", "token_type_ids"):
                path = self.directory / f"{name}.npy"
                if path.exists():
                    arrays[name] = np.load(path, mmap_mode="r")
            self._arrays = arrays
            self._pid = os.getpid()
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = None
        return state

    def __getitem__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        arrays = self._open()
        index = np.asarray(indices, dtype=np.int64)
        real = index >= 0
        rows = np.where(real, index, 0)
        input_ids = torch.from_numpy(np.asarray(arrays["input_ids"][rows], dtype=np.int64))
        lengths = torch.from_numpy(np.asarray(arrays["lengths"][rows], dtype=np.int64))
        positions = torch.arange(self.max_length)
        attention_mask = (positions[None, :] < lengths[:, None]).long()
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "weight": torch.from_numpy(real.astype(np.float32)),
        }
        if "token_type_ids" in arrays:
            batch["token_type_ids"] = torch.from_numpy(
                np.asarray(arrays["token_type_ids"][rows], dtype=np.int64)
            )
        if self.task == "classification":
            batch["labels"] = torch.from_numpy(np.asarray(arrays["labels"][rows], dtype=np.int64))
        else:
            batch["labels"] = input_ids.masked_fill(attention_mask == 0, -100)
        return batch


# -- batches --------------------------------------------------------------------------------


class TrainBatches:
    """Index lists of this rank's training batches: a fresh shuffle every epoch, the tail
    that does not fill a whole step dropped (every batch has the same shape).

    Step ``b`` of epoch ``e`` takes examples ``perm[b*W*B : (b+1)*W*B]`` of the epoch's
    permutation (seeded by seed and epoch), and rank ``r`` its slice ``r*B : (r+1)*B``, so
    the order depends only on (seed, epoch, world size, batch size) and a resumed job can
    start in the middle of an epoch with ``set_position``.
    """

    def __init__(self, examples: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.examples = examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_step = batch_size * world_size
        self.steps_per_epoch = examples // self.per_step
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training split has {examples} examples, fewer than one step takes "
                f"(batch size {batch_size} x {world_size} processes)"
            )
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Start the next iteration at batch ``start`` of ``epoch``."""
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        perm = torch.randperm(self.examples, generator=generator).numpy()
        for step in range(self.start, self.steps_per_epoch):
            first = step * self.per_step + self.rank * self.batch_size
            yield perm[first : first + self.batch_size].tolist()


class EvalBatches:
    """Index lists of this rank's evaluation batches: all examples once, in order, the last
    batches padded with -1 so that every rank runs the same number of same-shape batches."""

    def __init__(self, examples: int, batch_size: int, rank: int, world_size: int):
        self.examples = examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        per_step = batch_size * world_size
        self.steps = -(-examples // per_step)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        per_step = self.batch_size * self.world_size
        for step in range(self.steps):
            first = step * per_step + self.rank * self.batch_size
            yield [i if i < self.examples else -1 for i in range(first, first + self.batch_size)]


def make_loader(
    split: TokenizedSplit,
    batches: TrainBatches | EvalBatches,
    *,
    num_workers: int,
    pin_memory: bool,
    seed: int,
) -> torch.utils.data.DataLoader[dict[str, torch.Tensor]]:
    """A DataLoader over whole batches (the split indexes a list of rows at once).

    It gets a generator of its own: creating an iterator then draws from it and not from
    the global RNG, which would shift dropout masks on a resume.
    """
    return torch.utils.data.DataLoader(
        split,  # type: ignore[arg-type]
        sampler=batches,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )
