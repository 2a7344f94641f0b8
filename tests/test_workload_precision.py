"""Precision is one decision: train.py's --precision (torch autocast), never the compiler's.

The launcher's NEURON_CC_FLAGS must leave casting to the trainer (``--auto-cast=none``), and
the trainer refuses, in one line, any compiler auto-cast that would override it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.workload_support import REPO, error_lines, make_data, run_train
from workload.backend import BackendError, check_compiler_precision, compiler_autocast

LIB = REPO / "scripts" / "node" / "lib.sh"


def launcher_neuron_cc_flags(**environment: str) -> str:
    """NEURON_CC_FLAGS as the node library exports it for a job on a Trainium node."""
    script = (
        'set -Eeuo pipefail; source "$1"; HOSTS=(10.1.0.12); NODE_ADDRESS=10.1.0.12; '
        'MASTER_PORT=29500; ON_TRAINIUM=1; export_job_environment; printf "%s" "$NEURON_CC_FLAGS"'
    )
    env = {"PATH": "/usr/bin:/bin", **environment}
    result = subprocess.run(
        ["bash", "-c", script, "bash", str(LIB)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return result.stdout


def test_the_launchers_compiler_flags_pass_the_trainers_check() -> None:
    flags = launcher_neuron_cc_flags()
    assert compiler_autocast(flags) == "none"
    for precision in ("bf16", "fp32"):
        check_compiler_precision(flags, precision)  # raises on a conflict


def test_an_operator_override_that_casts_is_caught_by_the_trainer() -> None:
    flags = launcher_neuron_cc_flags(
        NEURON_CC_FLAGS="--model-type=transformer --auto-cast=all --auto-cast-type=bf16"
    )
    with pytest.raises(BackendError, match="--auto-cast=all"):
        check_compiler_precision(flags, "bf16")


@pytest.mark.parametrize(
    ("flags", "value"),
    [
        ("", None),
        ("--optlevel=1", None),
        ("--auto-cast=none --optlevel=1", "none"),
        ("--auto-cast matmult", "matmult"),
        ("--auto-cast=all --model-type=transformer --auto-cast=none", "none"),  # the last wins
    ],
)
def test_compiler_autocast_reads_both_spellings(flags: str, value: str | None) -> None:
    assert compiler_autocast(flags) == value


@pytest.mark.parametrize("value", ["all", "matmult"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_every_compiler_autocast_but_none_is_refused(value: str, precision: str) -> None:
    with pytest.raises(BackendError) as raised:
        check_compiler_precision(f"--model-type=transformer --auto-cast={value}", precision)
    message = str(raised.value)
    assert f"--auto-cast={value}" in message
    assert f"--precision {precision}" in message
    assert "the only --auto-cast allowed is none" in message


@pytest.mark.xla
def test_train_py_under_xla_refuses_a_conflicting_compiler_cast(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data", train=16, test=8)
    result = run_train(
        ["--data", str(data), "--output", str(tmp_path / "job"), "--device", "xla"],
        xla=True,
        extra_env={"NEURON_CC_FLAGS": "--model-type=transformer --auto-cast=all"},
        timeout=300,
    )
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert "NEURON_CC_FLAGS has --auto-cast=all, which conflicts with --precision fp32" in lines[0]
    assert "Traceback" not in result.stderr
