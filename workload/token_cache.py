"""The token cache: each split tokenized once into fixed-shape, memory-mapped ``.npy`` arrays.

The cache's key names the files (path, size, modification time), the tokenizer's whole
definition, the task and the sequence length, so any change writes a new cache. Arrays are
written to a temporary directory and renamed into place: a cache is either complete or
absent. Training reads them memory-mapped (``TokenizedSplit``): a rank touches only the rows
of its own shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workload.checkpoint import fsync_path
from workload.data import DataError, RawSplit

log = logging.getLogger(__name__)

CACHE_VERSION = 1
TOKENIZE_BATCH = 4096


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
            fsync_path(child)
        fsync_path(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not a lost race with another node writing the same cache
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_path(target.parent)
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
