"""The data: find, read and validate the splits (the token cache and batches come after).

Layout (as Amazon Polarity ships it): a directory with ``train.<ext>`` and ``test.<ext>``
(or shards ``train-*.<ext>``, also one folder down as in Hugging Face dataset repos), where
``<ext>`` is parquet, jsonl or csv, and the columns are ``label`` (0 negative, 1 positive),
``title`` and ``content``. A Hugging Face dataset name is downloaded into that layout first.

Every problem in the input (missing file or column, unreadable file, empty text, label
outside {0, 1}) raises ``DataError`` naming the file, the row and the reason, before any
cache is written (``workload/token_cache.py`` tokenizes the splits once; ``workload/batches.py``
batches them).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
FORMATS = ("parquet", "jsonl", "csv")
LABELS = (0, 1)

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
