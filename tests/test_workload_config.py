"""The training configuration: flags, YAML files, their order, and one-line refusals."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.workload_support import REPO, TRAIN_PY, error_lines, run_train
from workload.config import ConfigError, TrainConfig, config_from_dict, parse_config

REQUIRED = ["--data", "d", "--output", "o"]


def test_defaults_and_flags() -> None:
    config = parse_config([*REQUIRED, "--max-steps", "7", "--lr", "3e-4", "--device", "cpu"])
    assert config.max_steps == 7
    assert config.lr == pytest.approx(3e-4)
    assert config.device == "cpu"
    assert config.model == "tiny"
    assert config.task == "classification"
    assert config.peak_lr == pytest.approx(3e-4)


def test_peak_lr_depends_on_the_kind_of_model() -> None:
    assert parse_config(REQUIRED).peak_lr == pytest.approx(1e-3)
    assert parse_config([*REQUIRED, "--model", "bert-base-uncased"]).peak_lr == pytest.approx(5e-5)


def test_config_file_and_flags_apply_in_order(tmp_path: Path) -> None:
    file = tmp_path / "job.yaml"
    file.write_text("batch-size: 4\nmax_steps: 9\nlr: 0.01\n")
    later_flag = parse_config([*REQUIRED, "--config", str(file), "--batch-size", "8"])
    assert (later_flag.batch_size, later_flag.max_steps, later_flag.lr) == (8, 9, 0.01)
    later_file = parse_config([*REQUIRED, "--batch-size", "8", "--config", str(file)])
    assert later_file.batch_size == 4


def test_config_file_can_hold_everything(tmp_path: Path) -> None:
    file = tmp_path / "job.yaml"
    file.write_text("data: /fsx/data\noutput: /fsx/jobs/a\ntask: causal-lm\nepochs: 2\n")
    config = parse_config(["--config", str(file)])
    assert (config.data, config.output, config.task, config.epochs) == (
        "/fsx/data",
        "/fsx/jobs/a",
        "causal-lm",
        2,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "d"], "--output is required"),
        ([*REQUIRED, "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        ([*REQUIRED, "--lr", "fast"], "'fast' is not a valid float for lr"),
        ([*REQUIRED, "--epochs", "1.5"], "'1.5' is not a valid int for epochs"),
        ([*REQUIRED, "--epochs", "0"], "--epochs 0 must be at least 1"),
        ([*REQUIRED, "--device", "tpu"], "--device 'tpu' is not one of auto, cpu, cuda, xla"),
        ([*REQUIRED, "--task", "qa"], "not one of classification, causal-lm"),
        ([*REQUIRED, "--warmup-ratio", "1.5"], "--warmup-ratio 1.5 must be in [0, 1)"),
        ([*REQUIRED, "--graphs-per-step", "3"], "--graphs-per-step 3 is not one of 1, 2"),
        ([*REQUIRED, "--tiny-hidden-size", "100", "--tiny-heads", "3"], "multiple of"),
        ([*REQUIRED, "--batch-size"], "expected one argument"),
        ([*REQUIRED, "--config", "/nonexistent.yaml"], "cannot read it"),
    ],
)
def test_bad_values_are_one_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(argv)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("learning_rate: 0.1\n", "unknown key 'learning_rate'; allowed keys: data, output"),
        ("- just\n- a list\n", "expected a mapping"),
        ("epochs: [1\n", "is not valid YAML"),
        ("epochs: three\n", "'three' is not a valid int for epochs"),
        ("max_steps: true\n", "True is not a valid int for max_steps"),
    ],
)
def test_bad_config_files(tmp_path: Path, content: str, message: str) -> None:
    file = tmp_path / "job.yaml"
    file.write_text(content)
    with pytest.raises(ConfigError, match=r"job\.yaml") as caught:
        parse_config([*REQUIRED, "--config", str(file)])
    assert message in str(caught.value)


def test_round_trip_through_a_checkpoint_dict() -> None:
    config = parse_config([*REQUIRED, "--epochs", "2", "--dropout", "0.1"])
    assert config_from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown config keys"):
        config_from_dict({**config.to_dict(), "stale_key": 1})


def test_dataclass_validates_directly() -> None:
    with pytest.raises(ConfigError, match="--keep-checkpoints 0 must be at least 1"):
        TrainConfig(data="d", output="o", keep_checkpoints=0)


def test_command_line_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_train(
        ["--data", str(tmp_path), "--output", str(tmp_path / "out"), "--max-stepz", "3"],
        timeout=300,
    )
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "train.py: error: unrecognized arguments: --max-stepz 3 (train.py --help lists the flags)"
    ]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# Rank 0 waits for torchrun's SIGTERM (sent to a node's other workers once one has exited):
# whatever the timing, rank 1 finds the error first and rank 0 never prints anything.
RANK_ZERO_LAST = textwrap.dedent(
    f"""
    import os, runpy, signal, sys
    if os.environ["RANK"] == "0":
        signal.pause()  # until torchrun's SIGTERM, whose default action ends it
        sys.exit(99)
    sys.path[0] = {str(TRAIN_PY.parent)!r}
    sys.argv[0] = {str(TRAIN_PY)!r}
    runpy.run_path({str(TRAIN_PY)!r}, run_name="__main__")
    """
)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--max-stepz", "3"],
            "unrecognized arguments: --max-stepz 3 (train.py --help lists the flags)",
        ),
        (["--device", "cuda"], "--device cuda: no CUDA device is visible to this process"),
    ],
    ids=["config", "backend"],
)
def test_the_error_is_printed_when_another_rank_than_0_finds_it_first(
    tmp_path: Path, flags: list[str], line: str
) -> None:
    # A ConfigError and a BackendError: rank 0 alone printed them, so a job whose rank 0 was
    # SIGTERMed by torchrun before it got there (another rank exited first) ended without it.
    script = tmp_path / "rank_zero_last.py"
    script.write_text(RANK_ZERO_LAST)
    args = ["--data", str(tmp_path), "--output", str(tmp_path / "out"), *flags]
    result = run_train(args, nproc=2, script=script, cwd=REPO, timeout=300)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [f"train.py: error: {line}"], result.stderr[-3000:]
    # torchrun reports the failed worker with its own traceback; none runs through ours.
    assert 'File "' + str(REPO / "workload") not in result.stderr


def test_output_and_data_default_to_the_launchers_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """launch.sh passes no --output: the job's directory is TRAINIUM_OUTPUT_DIR, and `train
    --data` is TRAINIUM_DATA_DIR (docs/operating.md, the job's environment); a flag wins."""
    monkeypatch.delenv("TRAINIUM_OUTPUT_DIR", raising=False)
    monkeypatch.delenv("TRAINIUM_DATA_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"--output is required .*TRAINIUM_OUTPUT_DIR"):
        parse_config(["--data", str(tmp_path)])
    monkeypatch.setenv("TRAINIUM_OUTPUT_DIR", "/fsx/jobs/bert-1")
    monkeypatch.setenv("TRAINIUM_DATA_DIR", "/fsx/data/polarity")
    config = parse_config([])
    assert (config.output, config.data) == ("/fsx/jobs/bert-1", "/fsx/data/polarity")
    assert parse_config(["--data", str(tmp_path)]).data == str(tmp_path)
