"""The training configuration: one typed dataclass, set from a YAML file and/or flags.

Every field is a flag (``max_steps`` is ``--max-steps``) and a key of the YAML file given
with ``--config``. Flags and files apply in command-line order, so a later one overrides
an earlier one. Unknown keys and bad values raise ``ConfigError`` with one line that names
what is wrong and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from .backend import DEVICE_CHOICES, PRECISION_CHOICES
from .engine import GRAPHS_PER_STEP, TASKS

COMPILE = ("auto", "on", "off")


class ConfigError(ValueError):
    """A bad flag, config key or value."""


def _help(text: str, choices: Sequence[str] | None = None) -> dict[str, Any]:
    return {"help": text, "choices": tuple(choices) if choices else None}


@dataclass(frozen=True)
class TrainConfig:
    """What to train, on what, for how long, and where to write it."""

    data: str = field(
        default="",
        metadata=_help(
            "directory with train.* and test.* (parquet, jsonl or csv), "
            "or a Hugging Face dataset name"
        ),
    )
    output: str = field(
        default="", metadata=_help("job directory: metrics, checkpoints, TensorBoard, resume")
    )
    model: str = field(
        default="tiny",
        metadata=_help("'tiny' (small model from a config), a hub name, or a local path"),
    )
    task: str = field(default="classification", metadata=_help("what to train", TASKS))
    epochs: int = field(default=3, metadata=_help("passes over the training split"))
    max_steps: int = field(
        default=0, metadata=_help("stop after this many optimizer steps (0 = run all epochs)")
    )
    batch_size: int = field(default=16, metadata=_help("examples per process per step"))
    max_length: int = field(
        default=128, metadata=_help("tokens per example; every batch is padded to it")
    )
    lr: float = field(
        default=0.0,
        metadata=_help("peak learning rate (0 = 1e-3 for tiny models, 5e-5 for pretrained)"),
    )
    weight_decay: float = field(default=0.01, metadata=_help("AdamW weight decay"))
    warmup_ratio: float = field(
        default=0.1, metadata=_help("fraction of the steps spent warming up the lr")
    )
    max_grad_norm: float = field(
        default=1.0, metadata=_help("clip the gradient norm to this (0 = no clipping)")
    )
    dropout: float = field(
        default=-1.0,
        metadata=_help("dropout probability (-1 = the model's own; 0 for tiny models)"),
    )
    checkpoint_every: int = field(
        default=500, metadata=_help("save every K steps (0 = only at the end)")
    )
    keep_checkpoints: int = field(default=3, metadata=_help("how many checkpoints to keep"))
    eval_every: int = field(
        default=0, metadata=_help("evaluate every K steps (0 = at the end of each epoch)")
    )
    log_every: int = field(default=10, metadata=_help("a metrics line every K steps"))
    device: str = field(default="auto", metadata=_help("where to train", DEVICE_CHOICES))
    precision: str = field(
        default="auto",
        metadata=_help("bf16 autocast or fp32 (auto: bf16 on Neuron/GPU)", PRECISION_CHOICES),
    )
    compile: str = field(
        default="auto",
        metadata=_help("torch.compile the forward (auto: on for cuda; never on xla)", COMPILE),
    )
    graphs_per_step: int = field(
        default=1,
        metadata=_help(
            "xla: graphs a training step is cut into; 1 (one graph: the gradient all-reduce "
            "can overlap the backward pass) or 2 (a cut after forward + backward)"
        ),
    )
    seed: int = field(default=42, metadata=_help("random seed (init, data order, dropout)"))
    num_workers: int = field(default=0, metadata=_help("data-loader worker processes"))
    cache_dir: str = field(
        default="",
        metadata=_help("token cache directory (default: <data>/.token-cache, else <output>)"),
    )
    tiny_hidden_size: int = field(default=128, metadata=_help("tiny model: hidden size"))
    tiny_layers: int = field(default=2, metadata=_help("tiny model: transformer layers"))
    tiny_heads: int = field(default=4, metadata=_help("tiny model: attention heads"))
    tiny_vocab_size: int = field(default=8000, metadata=_help("tiny model: tokenizer vocabulary"))
    peak_tflops: float = field(
        default=0.0,
        metadata=_help("per-device peak TFLOP/s for MFU (0 = from the built-in table)"),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{_flag(f.name)} {value!r} is not one of {', '.join(choices)}")
        if not self.data:
            raise ConfigError(
                "--data is required (a directory with train.* and test.*; default: "
                "$TRAINIUM_DATA_DIR, which `cluster.py train --data` sets)"
            )
        if not self.output:
            raise ConfigError(
                "--output is required (the job directory; default: $TRAINIUM_OUTPUT_DIR)"
            )
        _at_least(self, "epochs", 1)
        _at_least(self, "max_steps", 0)
        _at_least(self, "batch_size", 1)
        _at_least(self, "max_length", 8)
        _at_least(self, "checkpoint_every", 0)
        _at_least(self, "keep_checkpoints", 1)
        _at_least(self, "eval_every", 0)
        _at_least(self, "log_every", 1)
        _at_least(self, "num_workers", 0)
        _at_least(self, "tiny_hidden_size", 8)
        _at_least(self, "tiny_layers", 1)
        _at_least(self, "tiny_heads", 1)
        _at_least(self, "tiny_vocab_size", 100)
        _at_least(self, "lr", 0.0)
        _at_least(self, "weight_decay", 0.0)
        _at_least(self, "max_grad_norm", 0.0)
        _at_least(self, "peak_tflops", 0.0)
        if self.graphs_per_step not in GRAPHS_PER_STEP:
            raise ConfigError(
                f"--graphs-per-step {self.graphs_per_step} is not one of "
                f"{', '.join(map(str, GRAPHS_PER_STEP))}"
            )
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"--warmup-ratio {self.warmup_ratio} must be in [0, 1)")
        if self.dropout != -1.0 and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--dropout {self.dropout} must be in [0, 1) (or -1 for default)")
        if self.tiny_hidden_size % self.tiny_heads:
            raise ConfigError(
                f"--tiny-hidden-size {self.tiny_hidden_size} must be a multiple of "
                f"--tiny-heads {self.tiny_heads}"
            )

    @property
    def is_tiny(self) -> bool:
        return self.model == "tiny"

    @property
    def peak_lr(self) -> float:
        """The learning rate in force (``lr``, or the default for the kind of model)."""
        if self.lr > 0:
            return self.lr
        return 1e-3 if self.is_tiny else 5e-5

    @property
    def compile_model(self) -> bool | None:
        """``compile`` for ``TrainStep``: None lets it choose for the device."""
        return {"auto": None, "on": True, "off": False}[self.compile]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(config: TrainConfig, name: str, minimum: float) -> None:
    value = getattr(config, name)
    if value < minimum:
        raise ConfigError(f"{_flag(name)} {value} must be at least {minimum}")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _convert(name: str, value: Any, source: str) -> Any:
    """``value`` as the type of field ``name``, or a ConfigError naming ``source``."""
    kind = _FIELDS[name].type
    try:
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            converted: Any = int(value)
        elif kind == "float":
            if isinstance(value, bool):
                raise ValueError
            converted = float(value)
            if not math.isfinite(converted):
                raise ValueError
        else:
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError
            converted = str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {value!r} is not a valid {kind} for {name}") from None
    return converted


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (train.py --help lists the flags)")


class _Record(argparse.Action):
    """Collect (name, value, source) in command-line order; files are expanded in place."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = getattr(namespace, "items", None) or []
        if self.dest == "config":
            items.extend(load_config_file(Path(values)))
        else:
            items.append((self.dest, values, option_string or self.dest))
        namespace.items = items


def load_config_file(path: Path) -> list[tuple[str, Any, str]]:
    """The (key, value, source) items of a YAML config file, keys checked."""
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config {path}:{where} is not valid YAML") from None
    if content is None:
        return []
    if not isinstance(content, Mapping):
        raise ConfigError(f"--config {path}: expected a mapping of key: value")
    items = []
    for raw_key, value in content.items():
        key = str(raw_key).replace("-", "_")
        if key not in _FIELDS or key == "config":
            raise ConfigError(
                f"--config {path}: unknown key {raw_key!r}; allowed keys: {', '.join(_FIELDS)}"
            )
        items.append((key, value, f"{path}: {raw_key}"))
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py",
        description="Data-parallel fine-tuning on Trainium (XLA), CUDA or CPU; run it "
        "under torchrun. Flags and --config files apply in order.",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", action=_Record, metavar="FILE", help="YAML file with the same keys as flags"
    )
    for f in dataclasses.fields(TrainConfig):
        choices = f.metadata.get("choices")
        allowed = f"; one of {', '.join(choices)}" if choices else ""
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            action=_Record,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} (default: {f.default!r}{allowed})",
        )
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """The config from the command line (``argv`` without the program name)."""
    namespace = build_parser().parse_args(argv)
    values: dict[str, Any] = dict(environment_defaults())
    for name, value, source in getattr(namespace, "items", []):
        values[name] = _convert(name, value, source)
    return TrainConfig(**values)


def environment_defaults() -> dict[str, str]:
    """What the cluster's launcher gives every job (docs/job-contract.md): --output defaults
    to TRAINIUM_OUTPUT_DIR (the job's directory, /fsx/jobs/<job-id>) and --data to
    TRAINIUM_DATA_DIR (`cluster.py train --data`), when set; a flag or --config wins."""
    variables = {"output": "TRAINIUM_OUTPUT_DIR", "data": "TRAINIUM_DATA_DIR"}
    return {name: os.environ[var] for name, var in variables.items() if os.environ.get(var)}


def config_from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """A config saved with ``to_dict`` (e.g. from a checkpoint); unknown keys are errors."""
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; allowed keys: {', '.join(_FIELDS)}")
    return TrainConfig(**{k: _convert(k, v, f"config {k}") for k, v in values.items()})
