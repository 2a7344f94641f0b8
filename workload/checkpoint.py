"""Checkpoints: atomic, portable, the latest K kept, found again on start.

``OUTPUT/checkpoints/step_<8-digit step>/`` holds

- ``model.safetensors`` and ``config.json``: the weights as CPU tensors in the Hugging Face
  layout, together with the tokenizer files, so the directory loads with
  ``from_pretrained`` (or ``--model <dir>``) on CPU, GPU or Trainium;
- ``trainer_state.pt`` (``torch.load(..., weights_only=True)``): optimizer, scheduler,
  step, epoch and batch position, samples seen, the RNG state of every rank, the
  resolved config;
- ``train_config.yaml``: the resolved config, for people.

A checkpoint is written into ``.tmp-step_<N>-<pid>/``, every file fsynced, then renamed
into place: the rename is the commit, so a crash during a save leaves the previous
checkpoint as the latest complete one. Only rank 0 writes. ``ModelSnapshot`` is the model's
part of a save copied to host memory, which ``workload/checkpoint_writer.py`` writes while
training goes on.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "train_config.yaml"
REQUIRED_FILES = (MODEL_FILE, STATE_FILE, "config.json")
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or does not fit the model."""


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f"step_{step:08d}"


def list_checkpoints(output: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``output``, oldest first."""
    root = output / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and all((child / f).is_file() for f in REQUIRED_FILES):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output: Path) -> Path | None:
    checkpoints = list_checkpoints(output)
    return checkpoints[-1][1] if checkpoints else None


def remove_partial(output: Path) -> None:
    """Delete temporary directories left by a save that was killed."""
    root = output / CHECKPOINTS
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(".tmp-") and child.is_dir():
                log.info("removing the unfinished save %s", child)
                shutil.rmtree(child, ignore_errors=True)


def tied_parameter_names(model: nn.Module) -> set[str]:
    """State-dict names that alias another parameter (e.g. GPT-2's LM head = embedding)."""
    unique = {name for name, _ in model.named_parameters()}
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - unique


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _xla_to_cpu(value: Any) -> Any:
    """``value`` with its XLA tensors on the CPU, fetched in one transfer.

    Moving them one by one costs a device round trip each (a BERT-base checkpoint holds
    about 600 tensors); ``xm._maybe_convert_to_cpu`` is how ``xm.save`` fetches a whole
    state at once (torch_xla/core/xla_model.py).
    """
    if not any(t.device.type == "xla" for t in _tensors(value)):
        return value
    import torch_xla.core.xla_model as xm

    return xm._maybe_convert_to_cpu(value)


def to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor moved to the CPU (nested dicts/lists/tuples)."""
    return _copy_to_cpu(_xla_to_cpu(value))


def _copy_to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: _copy_to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_to_cpu(v) for v in value)
    return value


def model_state_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as contiguous CPU tensors, tied duplicates left out."""
    tied = tied_parameter_names(model)
    state = {n: t.detach() for n, t in model.state_dict().items() if n not in tied}
    return {name: tensor.contiguous() for name, tensor in to_cpu(state).items()}


@dataclass(frozen=True)
class ModelSnapshot:
    """What a checkpoint keeps of the model, copied to host memory at the step it is taken:
    the weights (contiguous CPU tensors, tied duplicates left out) and the model's config."""

    tensors: dict[str, torch.Tensor]
    config_json: str

    @classmethod
    def of(cls, model: nn.Module) -> ModelSnapshot:
        model_config: Any = getattr(model, "config")  # noqa: B009  (a transformers model)
        return cls(model_state_cpu(model), model_config.to_json_string())


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*"), reverse=True):
        fsync_path(path)
    fsync_path(directory)


def fsync_path(path: Path) -> None:
    """Flush a file or directory to disk (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    output: Path,
    step: int,
    model: nn.Module | ModelSnapshot,
    tokenizer: Any,
    trainer_state: Mapping[str, Any],
    *,
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically and delete all but the newest ``keep``.

    ``model`` is the bare model (not DDP; tensors may live on any device) or a snapshot of
    it. ``trainer_state`` must hold only CPU tensors and plain Python values.
    """
    final = checkpoint_dir(output, step)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        snapshot = model if isinstance(model, ModelSnapshot) else ModelSnapshot.of(model)
        save_file(snapshot.tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(snapshot.config_json, encoding="utf-8")
        tokenizer.save_pretrained(str(tmp))
        torch.save(dict(trainer_state), tmp / STATE_FILE)
        config = trainer_state.get("config")
        if config is not None:
            (tmp / CONFIG_FILE).write_text(yaml.safe_dump(dict(config), sort_keys=False))
        _fsync_tree(tmp)
        tmp.rename(final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(output, keep)
    return final


def prune(output: Path, keep: int) -> None:
    """Keep only the newest ``keep`` complete checkpoints."""
    for _, path in list_checkpoints(output)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load ``path``'s weights into ``model`` (any device); tied names may be absent."""
    state = load_file(str(path / MODEL_FILE), device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in tied_parameter_names(model)]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (CPU tensors, plain values)."""
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / STATE_FILE}: not a trainer state this version reads")
    return state
