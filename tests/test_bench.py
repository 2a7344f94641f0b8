"""The throughput benchmark (workload/bench.py) on the CPU: tiny model, a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workload import bench

REPO = Path(__file__).resolve().parent.parent
STEPS, ROUNDS, BATCH, SEQ = 3, 2, 4, 32


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Path]:
    """One benchmark run as a user starts it; its stdout, bench.json and output folder."""
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "USE_TORCH_XLA")}
    stdout = run_bench(
        env,
        *("--model", "tiny", "--device", "cpu", "--threads", "1"),
        *("--steps", str(STEPS), "--rounds", str(ROUNDS), "--warmup", "1"),
        *("--batch-size", str(BATCH), "--seq-len", str(SEQ), "--output", str(out)),
    )
    return stdout, json.loads((out / "bench.json").read_text()), out


def run_bench(env: dict[str, str], *args: str) -> str:
    """Runs workload/bench.py as a user would; returns its stdout."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "workload" / "bench.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _results(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["path"]: r for r in report["results"]}


def test_times_the_trainer_step_and_the_plain_loop(
    cpu_run: tuple[str, dict[str, Any], Path],
) -> None:
    _, report, _ = cpu_run
    assert report["machine"]["device"] == "cpu"
    assert report["machine"]["torch_threads"] == 1
    assert report["machine"]["peak_tflops_bf16_per_device"] is None
    results = _results(report)
    assert list(results) == ["trainer", "plain", "hf-trainer"]
    for name in ("trainer", "plain"):
        r = results[name]
        assert r["status"] == "ok"
        assert r["steps"] == STEPS * ROUNDS == len(r["step_seconds"])
        assert r["step_ms_min"] <= r["step_ms_p10"] <= r["step_ms_median"]
        assert r["step_ms_median"] <= r["step_ms_p90"] <= r["step_ms_max"]
        assert r["samples_per_second"] == pytest.approx(BATCH * 1000 / r["step_ms_median"])
        assert r["tokens_per_second"] == pytest.approx(r["samples_per_second"] * SEQ)
        assert r["samples_per_second_mean"] == pytest.approx(
            BATCH * r["steps"] / sum(r["step_seconds"]), rel=1e-3
        )
        assert r["mfu"] is None  # no MFU on a CPU
        assert r["warmup_seconds"] > 0
        assert r["compilations_warmup"] is None  # XLA only
    trainer, plain = results["trainer"], results["plain"]
    assert trainer["ratio_vs_plain"] == pytest.approx(
        trainer["samples_per_second"] / plain["samples_per_second"]
    )
    # A gross regression shows even on a busy machine; the measured figures are in the README.
    assert trainer["ratio_vs_plain"] > 0.4
    assert trainer["features"][0] == "fp32"
    assert "fp32" in plain["features"] and "eager" in plain["features"]
    assert report["process_peak_memory_kind"] == "process peak RSS"
    assert report["process_peak_memory_bytes"] > 10 * 2**20


def test_hf_trainer_baseline_runs_or_says_why_not(
    cpu_run: tuple[str, dict[str, Any], Path],
) -> None:
    stdout, report, _ = cpu_run
    hf = _results(report)["hf-trainer"]
    trainer = _results(report)["trainer"]
    if hf["status"] == "ok":
        assert hf["steps"] == STEPS * ROUNDS
        assert trainer["ratio_vs_hf_trainer"] == pytest.approx(
            trainer["samples_per_second"] / hf["samples_per_second"]
        )
        assert "x vs hf-trainer" in stdout
    else:
        assert hf["status"] == "skipped"
        assert "accelerate" in hf["reason"]
        assert hf["reason"] in stdout
        assert trainer["ratio_vs_hf_trainer"] is None


def test_prints_the_comparison_and_writes_json_and_png(
    cpu_run: tuple[str, dict[str, Any], Path],
) -> None:
    stdout, report, out = cpu_run
    ratio = _results(report)["trainer"]["ratio_vs_plain"]
    assert f"tiny: the trainer's step is {ratio:.2f}x the plain loop" in stdout
    assert "| model | path | samples/s |" in stdout  # the README table
    assert "Traceback" not in stdout
    assert report["plot"] == "bench.png"
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    import matplotlib.image

    height, width = matplotlib.image.imread(out / "bench.png").shape[:2]
    assert width >= 400 and height >= 150


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--model huge", "argument --model: invalid choice: 'huge'"),
        ("--steps 0", "argument --steps: expected a whole number >= 1, got '0'"),
        ("--paths trainer,fast", "expected a comma-separated list of trainer, plain, hf-trainer"),
        ("--model bert-base --task causal-lm", "--task applies to --model tiny only"),
        ("--device cuda", "--device cuda"),
    ],
)
def test_bad_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], args: str, message: str
) -> None:
    if "cuda" in args and bench.torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    try:
        code = bench.main(args.split())
    except SystemExit as exc:  # argparse's own checks
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert message in err


@pytest.mark.xla
@pytest.mark.slow
def test_xla_reports_compilations_and_compile_time(tmp_path: Path) -> None:
    """The Trainium code path (torch-xla on the CPU): warm-up compiles, timed steps do not."""
    pytest.importorskip("torch_xla")
    env = {k: v for k, v in os.environ.items() if k != "USE_TORCH_XLA"} | {"PJRT_DEVICE": "CPU"}
    stdout = run_bench(
        env,
        *("--device", "xla", "--paths", "trainer,hf-trainer", "--threads", "1"),
        *("--steps", "2", "--rounds", "1", "--warmup", "3"),
        *("--batch-size", "2", "--seq-len", "16", "--output", str(tmp_path)),
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["machine"]["device"] == "xla:CPU"
    trainer, hf = _results(report)["trainer"], _results(report)["hf-trainer"]
    assert trainer["compilations_warmup"] >= 2  # forward+backward, optimizer update
    assert trainer["compilations_measured"] == 0  # fixed shapes: nothing new to compile
    assert trainer["compile_seconds"] > 0
    assert trainer["features"][1] == "foreach AdamW"  # fused is CPU/CUDA only
    assert hf["status"] == "skipped" and "optimum-neuron" in hf["reason"]
    assert "compiles (warm-up+timed)" in stdout
