"""The cost model: scripts/estimate_cost.py."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stacks.instance_types import INSTANCE_TYPES, PRICES_AS_OF

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "estimate_cost.py"

# The SageMaker benchmark (BERT-base classification, same batch and data, one node each).
SEED_ARGS = [
    "--instance-type", "ml.trn1.32xlarge", "--price", "24.725",
    "--unit", "it/s", "--throughput", "6.64", "--seconds", "6033",
    "--compare", "ml.p4d.24xlarge=5.44", "--price", "ml.p4d.24xlarge=37.69",
    "--seconds", "ml.p4d.24xlarge=6553",
]  # fmt: skip


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("estimate_cost", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ec = _load()


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert ec.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert ec.main(list(args)) == 0
    return capsys.readouterr().out


def table_price(name: str) -> float:
    price = INSTANCE_TYPES[name].on_demand_usd_per_hour
    assert price is not None
    return price


def by_type(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["instance_type"]: e for e in report["estimates"]}


def test_reproduces_the_sagemaker_seed_table(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, *SEED_ARGS)
    est = by_type(report)
    trn, p4d = est["ml.trn1.32xlarge"], est["ml.p4d.24xlarge"]
    # The seed prints $41.47; its own inputs give 24.725 $/h x 6033 s = $41.435.
    assert trn["cost_usd"] == pytest.approx(24.725 * 6033 / 3600)
    assert round(trn["cost_usd"], 1) == 41.4
    assert abs(trn["cost_usd"] - 41.47) < 0.05
    assert round(p4d["cost_usd"], 1) == 68.6
    assert trn["instance_hours"] == pytest.approx(6033 / 3600)
    assert trn["price_source"] == p4d["price_source"] == "override"
    (cmp,) = report["comparisons"]
    assert cmp["instance_type"] == "ml.p4d.24xlarge"
    assert round(cmp["speedup"], 2) == 1.22  # "about 22% faster"
    assert round(1 - cmp["cost_ratio"], 2) == 0.40  # "about 40% cheaper"
    assert cmp["saving_usd"] == pytest.approx(68.606 - 41.435, abs=0.01)

    text = run_text(capsys, *SEED_ARGS)
    assert "$41.43" in text and "$68.61" in text and "$24.725" in text
    assert "22% faster (6.64 vs 5.44 it/s)" in text
    assert "40% cheaper" in text
    assert f"as of {PRICES_AS_OF}" in text


def test_time_and_cost_from_dataset_epochs_and_table_price(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(
        capsys,
        *("--instance-type", "trn1.32xlarge", "--nodes", "2", "--throughput", "1000"),
        *("--dataset-size", "1000000", "--epochs", "2", "--tokens-per-sample", "128"),
        *("--compare", "p4d.24xlarge=800"),
    )
    est = by_type(report)
    trn, p4d = est["trn1.32xlarge"], est["p4d.24xlarge"]
    price = table_price("trn1.32xlarge")
    assert trn["train_seconds"] == pytest.approx(2000)
    assert trn["instance_hours"] == pytest.approx(2 * 2000 / 3600)
    assert trn["cost_usd"] == pytest.approx(price * 2 * 2000 / 3600)
    assert trn["cost_per_million_samples_usd"] == pytest.approx(trn["cost_usd"] / 2)
    assert trn["cost_per_million_tokens_usd"] == pytest.approx(trn["cost_usd"] / 256)
    assert trn["price_source"] == f"on-demand us-east-1 {PRICES_AS_OF}"
    # The comparison runs the same work on the same node count at its own throughput.
    assert p4d["nodes"] == 2
    assert p4d["train_seconds"] == pytest.approx(2500)
    assert report["work"] == {"samples": 2_000_000, "tokens": 256_000_000}


def test_cold_compile_cache_is_billed_and_warm_saving_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = (
        "--nodes",
        "4",
        "--throughput",
        "100",
        "--samples",
        "360000",
        "--compile-seconds",
        "1800",
    )
    price = table_price("trn1.32xlarge")
    cold = by_type(run_json(capsys, *args, "--compare", "p5.48xlarge=100"))
    trn = cold["trn1.32xlarge"]
    assert trn["total_seconds"] == pytest.approx(3600 + 1800)
    assert trn["cost_usd"] == pytest.approx(price * 4 * 1.5)
    assert trn["warm_cache_saving_usd"] == pytest.approx(price * 4 * 0.5)
    assert cold["p5.48xlarge"]["warm_cache_saving_usd"] == 0

    warm = by_type(run_json(capsys, *args, "--cache", "warm"))["trn1.32xlarge"]
    assert warm["total_seconds"] == pytest.approx(3600)
    assert warm["cost_usd"] == pytest.approx(price * 4)
    assert warm["cost_cold_cache_usd"] == pytest.approx(trn["cost_usd"])

    text = run_text(capsys, *args)
    assert "compile time (cold cache)" in text and "30 min 00 s" in text
    assert f"${price * 4 * 0.5:,.2f}" in text  # the warm-cache saving


@pytest.mark.parametrize(
    ("args", "seconds"),
    [
        ("--unit it/s --throughput 2 --steps 1000", 500),
        ("--unit it/s --throughput 2 --samples 32000 --batch-size 32", 500),
        ("--unit samples/s --throughput 64 --steps 1000 --batch-size 32", 500),
        ("--unit tokens/s --throughput 512 --samples 1000 --tokens-per-sample 128", 250),
        ("--unit samples/s --throughput 4 --tokens 128000 --tokens-per-sample 128", 250),
    ],
)
def test_throughput_units_convert(
    capsys: pytest.CaptureFixture[str], args: str, seconds: float
) -> None:
    report = run_json(capsys, *args.split(), "--compare", "p4d.24xlarge")
    assert report["estimates"][0]["train_seconds"] == pytest.approx(seconds)


def test_break_even_throughput_for_gpus_without_a_throughput(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = run_text(capsys, "--throughput", "100", "--samples", "360000")
    trn_h = table_price("trn1.32xlarge")
    for name in ("p4d.24xlarge", "p5.48xlarge"):
        gpu_h = table_price(name)
        # Same cost: the GPU must do the hour's work in trn_h / gpu_h hours.
        assert f"{name} breaks even at {100 * gpu_h / trn_h:.4g} samples/s" in text


def test_measured_time_scales_to_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(
        capsys, "--throughput", "10", "--seconds", "1000", "--compare", "p5.48xlarge=20"
    )
    assert by_type(report)["p5.48xlarge"]["train_seconds"] == pytest.approx(500)


def _summary(**fields: Any) -> dict[str, Any]:
    """A "summary" line as workload/train.py writes it."""
    line = {
        "event": "summary",
        "step": 50,
        "total_time_s": 80.0,
        "train_time_s": 60.0,
        "mean_samples_per_second": 100.0,
        "mean_tokens_per_second": 12800.0,
        "world_size": 2,
        "batch_size": 50,
        "max_length": 128,
        "resumed_from": None,
    }
    return line | fields


def _write(path: Path, *lines: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_reads_a_trainer_metrics_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    metrics = _write(
        tmp_path / "metrics.jsonl",
        {"event": "train", "step": 10, "loss": 1.0, "samples_per_second": 90.0},
        {"event": "eval", "step": 10, "eval_loss": 0.9, "eval_accuracy": 0.5},
        _summary(),
    )
    report = run_json(capsys, "--metrics", str(metrics), "--compare", "p4d.24xlarge=50")
    trn = by_type(report)["trn1.32xlarge"]
    assert trn["throughput"] == 100 and trn["throughput_unit"] == "samples/s"
    assert trn["train_seconds"] == 80  # the run's wall time
    assert report["work"] == {"samples": 5000, "tokens": 640000}
    # Half the throughput: twice the time, overheads included.
    assert by_type(report)["p4d.24xlarge"]["train_seconds"] == pytest.approx(160)
    assert trn["cost_per_million_samples_usd"] == pytest.approx(trn["cost_usd"] / 5000 * 1e6)
    # Projected to a bigger dataset at the measured throughput.
    big = run_json(capsys, "--metrics", str(metrics), "--dataset-size", "100000", "--epochs", "3")
    assert big["estimates"][0]["train_seconds"] == pytest.approx(3000)


def test_metrics_of_a_multi_node_run_set_the_node_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metrics = _write(tmp_path / "metrics.jsonl", _summary(world_size=64, batch_size=4))
    trn = run_json(capsys, "--metrics", str(metrics))["estimates"][0]
    assert trn["nodes"] == 2  # 64 processes on 32 NeuronCores per trn1.32xlarge
    assert trn["instance_hours"] == pytest.approx(2 * 80 / 3600)


def test_metrics_of_a_resumed_run_leave_cost_per_sample_open(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metrics = _write(tmp_path / "metrics.jsonl", _summary(resumed_from="ckpt/step_00000020"))
    text = run_text(capsys, "--metrics", str(metrics))
    assert "resumed from a checkpoint" in text
    assert run_json(capsys, "--metrics", str(metrics))["work"]["samples"] is None


def test_metrics_file_without_summary_uses_train_events(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The first interval holds the warm-up and is left out.
    rates = [5.0, 80.0, 120.0]
    metrics = _write(
        tmp_path / "metrics.jsonl", *({"event": "train", "samples_per_second": r} for r in rates)
    )
    report = run_json(capsys, "--metrics", str(metrics), "--samples", "1000")
    assert report["estimates"][0]["train_seconds"] == pytest.approx(10)


def test_metrics_written_by_the_trainer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The contract with workload/train.py: a real run's metrics give a real estimate."""
    data, out = tmp_path / "data", tmp_path / "job"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    for command in (
        [ROOT / "scripts" / "make_sample_data.py", "--output", data, "--train-size", "48"],
        [
            ROOT / "workload" / "train.py",
            *("--data", data, "--output", out, "--max-steps", "4", "--batch-size", "8"),
            *("--device", "cpu", "--eval-every", "4"),
        ],
    ):
        proc = subprocess.run(
            [sys.executable, *map(str, command)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    report = run_json(capsys, "--metrics", str(out / "metrics.jsonl"), "--compare", "p5.48xlarge=1")
    trn = report["estimates"][0]
    assert trn["throughput"] > 0 and trn["train_seconds"] > 0
    assert report["work"]["samples"] == 4 * 8
    assert report["work"]["tokens"] == 4 * 8 * 128  # --max-length 128
    assert trn["cost_usd"] > 0 and trn["cost_per_million_samples_usd"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--throughput 1", "give the amount of work"),
        ("--samples 10", "give --throughput"),
        ("--instance-type x1.large --throughput 1 --samples 1", "unknown instance type 'x1.large'"),
        (
            "--instance-type ml.trn1.32xlarge --throughput 1 --samples 1",
            "--price ml.trn1.32xlarge=USD_PER_HOUR",
        ),
        (
            "--instance-type trn2.48xlarge --throughput 1 --samples 1",
            "no on-demand price for trn2.48xlarge",
        ),
        ("--throughput -3 --samples 1", "argument --throughput: expected a number > 0"),
        ("--throughput 1 --steps 10", "give --batch-size"),
        ("--throughput 1 --samples 1 --price p5.48xlarge=cheap", "--price 'p5.48xlarge=cheap'"),
        ("--throughput 1 --samples 1 --nodes 0", "--nodes '0'"),
        ("--throughput 1 --samples 1 --compare p5.48xlarge=fast", "--compare 'p5.48xlarge=fast'"),
        ("--throughput 1 --samples 1 --compare trn1.32xlarge=2", "different instance type"),
        ("--throughput 1 --samples 1 --epochs 2", "--epochs needs --dataset-size"),
        ("--throughput 1 --samples 1 --unit flops", "argument --unit: invalid choice"),
        ("--metrics /nonexistent/metrics.jsonl", "cannot read metrics file"),
    ],
)
def test_bad_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], args: str, message: str
) -> None:
    try:
        code = ec.main(args.split())
    except SystemExit as exc:  # argparse's own checks
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert message in err


def test_metrics_file_that_is_not_json_lines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"event": "train", "samples_per_second": 1}\nnot json\n')
    assert ec.main(["--metrics", str(bad)]) == 2
    assert f"{bad}:2: not a JSON line" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "eval", "eval_loss": 1}\n')
    assert ec.main(["--metrics", str(empty)]) == 2
    assert "no 'summary' or 'train' line with a throughput" in capsys.readouterr().err


def test_command_line_entry_point() -> None:
    ok = subprocess.run(
        [sys.executable, str(SCRIPT), *SEED_ARGS, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert round(json.loads(ok.stdout)["estimates"][0]["cost_usd"], 1) == 41.4
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--instance-type", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "unknown instance type 'nope'" in bad.stderr


def test_mixing_sagemaker_and_ec2_prices_is_pointed_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = run_text(
        capsys,
        *("--instance-type", "ml.trn1.32xlarge", "--price", "24.725"),
        *("--throughput", "10", "--samples", "36000", "--compare", "p4d.24xlarge=10"),
    )
    assert "ml.trn1.32xlarge and p4d.24xlarge: one is a SageMaker price, the other EC2" in text
    assert "SageMaker price" not in run_text(capsys, *SEED_ARGS)


def _bench_json(path: Path, device: str = "h100", **extra: Any) -> Path:
    """A bench.json as workload/bench.py writes it: the H100 BERT-base seq-128 run (README)."""
    rows = [
        {"model": "bert-base", "path": "trainer", "status": "ok",
         "samples_per_second": 4886.0, "tokens_per_second": 625_345.0},
        {"model": "bert-base", "path": "hf-trainer", "status": "ok",
         "samples_per_second": 4538.0, "tokens_per_second": 580_809.0},
    ]  # fmt: skip
    report = {
        "machine": {"device": "cuda:NVIDIA H100 80GB HBM3", "device_kind": "cuda"}
        | ({"peak_source": device} if device else {}),
        "batch_size": 512,
        "seq_len": 128,
        "results": rows + extra.get("more_rows", []),
    }
    path.write_text(json.dumps(report))
    return path


def test_bench_throughput_scales_to_the_nodes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = _bench_json(tmp_path / "bench.json")
    report = run_json(
        capsys,
        *("--throughput", "3800", "--samples", "1e8", "--nodes", "p5.48xlarge=2"),
        *("--compare", "p5.48xlarge", "--bench", f"p5.48xlarge={bench}"),
    )
    p5 = by_type(report)["p5.48xlarge"]
    # The trainer row (not the HF Trainer's): per device x 8 GPUs x 2 nodes.
    assert p5["throughput"] == pytest.approx(4886.0 * 8 * 2)
    assert p5["train_seconds"] == pytest.approx(1e8 / (4886.0 * 16))
    assert any("assuming linear scaling" in note and str(bench) in note for note in report["notes"])
    tokens = run_json(
        capsys,
        *("--throughput", "1e6", "--unit", "tokens/s", "--tokens", "1e10"),
        *("--compare", "p5.48xlarge", "--bench", f"p5.48xlarge={bench}"),
    )
    assert by_type(tokens)["p5.48xlarge"]["throughput"] == pytest.approx(625_345.0 * 8)


def test_bench_for_the_main_instance_type(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = _bench_json(tmp_path / "bench.json")
    report = run_json(
        capsys,
        *("--instance-type", "p5.48xlarge", "--bench", str(bench), "--samples", "1e7"),
        *("--compare", "p4d.24xlarge"),
    )
    assert by_type(report)["p5.48xlarge"]["throughput"] == pytest.approx(4886.0 * 8)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            "--throughput 1 --samples 1 --compare p4d.24xlarge --bench p4d.24xlarge=BENCH",
            "was measured on h100, but p4d.24xlarge has a100 devices",
        ),
        (
            "--throughput 1 --samples 1 --compare p5.48xlarge=9 --bench p5.48xlarge=BENCH",
            "a throughput and --bench p5.48xlarge; give one",
        ),
        (
            "--instance-type p5.48xlarge --throughput 1 --samples 1 --bench BENCH",
            "give --throughput or --bench, not both",
        ),
        (
            "--throughput 1 --steps 1 --batch-size 8 --unit it/s --compare p5.48xlarge "
            "--bench p5.48xlarge=BENCH",
            "--bench gives samples/s or tokens/s, not it/s",
        ),
        (
            "--throughput 1 --samples 1 --compare p5.48xlarge --bench p5.48xlarge=BENCH "
            "--bench-model gpt2",
            "no trainer result for --bench-model gpt2; choose --bench-model from: bert-base",
        ),
        ("--throughput 1 --samples 1 --bench p5.48xlarge=@MISSING", "cannot read it"),
        ("--throughput 1 --samples 1 --bench p5.48xlarge=@OTHER", "not a bench.json"),
    ],
)
def test_bad_bench_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: str, message: str
) -> None:
    bench = _bench_json(tmp_path / "bench.json")
    other = tmp_path / "metrics.jsonl"
    other.write_text('{"event": "summary"}\n')
    argv = [
        a.replace("@MISSING", str(tmp_path / "missing.json"))
        .replace("@OTHER", str(other))
        .replace("BENCH", str(bench))
        for a in args.split()
    ]
    assert ec.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert message in err


def test_bench_with_several_models_needs_bench_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    gpt2 = {"model": "gpt2", "path": "trainer", "status": "ok", "samples_per_second": 311.0,
            "tokens_per_second": 318_036.0}  # fmt: skip
    bench = _bench_json(tmp_path / "bench.json", more_rows=[gpt2])
    base = ["--throughput", "1", "--samples", "1e6", "--compare", "p5.48xlarge"]
    assert ec.main([*base, "--bench", f"p5.48xlarge={bench}"]) == 2
    assert "several models; choose --bench-model from: bert-base, gpt2" in capsys.readouterr().err
    report = run_json(capsys, *base, "--bench", f"p5.48xlarge={bench}", "--bench-model", "gpt2")
    assert by_type(report)["p5.48xlarge"]["throughput"] == pytest.approx(311.0 * 8)


# ------------------------------------------------------- checkpoint interval (Young / Daly)
CHECKPOINT_RUN = ["--nodes", "64", "--throughput", "3800", "--dataset-size", "1e8",
                  "--epochs", "3", "--compare", "p5.48xlarge=6000",
                  "--checkpoint-save-seconds", "60"]  # fmt: skip


def test_the_interruption_rate_is_meta_llama3s_per_node_hour() -> None:
    """419 unexpected interruptions in 54 days on 16,384 H100s, 8 a server (Llama 3 paper,
    section 3.3.4): 1.58e-4 per node-hour, one per 6,335 node-hours."""
    from scripts.cost_lib.interruptions import LLAMA3_RATE_PER_NODE_HOUR as LLAMA3_PER_NODE_HOUR

    assert pytest.approx(419 / (54 * 24 * 16_384 / 8)) == LLAMA3_PER_NODE_HOUR
    assert round(1 / LLAMA3_PER_NODE_HOUR) == 6335


def test_youngs_interval_is_where_dalys_exact_expected_run_time_is_least() -> None:
    """Daly 2006 (FGCS 22(3), eq. 13 with no restart time): a run of S seconds of work with
    exponentially distributed interruptions of mean M, saving C every tau, takes
    M (e^((tau + C) / M) - 1) S / tau. Its minimum, found numerically, is Young's
    sqrt(2 C M) to within C (Daly's next term), and the first-order overhead agrees."""
    from scripts.cost_lib.checkpoints import best_interval, overhead

    save, mean = 60.0, 99.0 * 3600

    def wall_per_work(tau: float) -> float:
        return mean * math.expm1((tau + save) / mean) / tau

    taus = [100 + step for step in range(0, 40_000, 5)]
    exact = min(taus, key=wall_per_work)
    young = best_interval(save, mean)
    assert abs(exact - young) <= save, (exact, young)
    assert overhead(young, save, mean) < min(overhead(young * f, save, mean) for f in (0.8, 1.25))
    assert overhead(young, save, mean) == pytest.approx(wall_per_work(exact) - 1, rel=0.02)


def test_estimate_shows_the_best_interval_and_the_cost_of_an_interruption(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, *CHECKPOINT_RUN, "--checkpoint-every-seconds", "1800")
    plan = report["checkpoints"]
    mean_s = 3600 / (419 / (54 * 24 * 2048) * 64)
    assert plan["mean_hours_between_interruptions"] == pytest.approx(mean_s / 3600)
    assert plan["best_interval_seconds"] == pytest.approx(math.sqrt(2 * 60 * mean_s))
    assert plan["lost_seconds_per_interruption"] == (1800 + 60) / 2
    run_s = by_type(report)["trn1.32xlarge"]["total_seconds"]
    assert plan["expected_interruptions"] == pytest.approx(run_s / mean_s)
    assert plan["expected_lost_seconds"] == pytest.approx(run_s / mean_s * 930)
    assert "Llama 3" in plan["rate_source"] and "Young 1974" in plan["interval_source"]
    text = run_text(capsys, *CHECKPOINT_RUN, "--checkpoint-every-seconds", "1800")
    assert "checkpoints on 64 x trn1.32xlarge: an interruption every 99.0 h" in text
    assert "save every 1 h 48 min 59 s of training" in text
    assert "at your interval of 30 min 00 s: 15 min 30 s lost per interruption" in text
    mine = run_json(capsys, *CHECKPOINT_RUN, "--interruptions-per-node-hour", "0.001")
    assert mine["checkpoints"]["mean_hours_between_interruptions"] == pytest.approx(1000 / 64)
    assert mine["checkpoints"]["lost_seconds_per_interruption"] is None
    assert run_json(capsys, *CHECKPOINT_RUN[:-2])["checkpoints"] is None


# Warm spares (scripts/cost_lib/spares.py): what spare_nodes cost against the waiting they save.

#: A 10-day run (--seconds) on trn1.32xlarge at the table's price, with one spare.
SPARE_ARGS = ["--seconds", "864000", "--compare", "p5.48xlarge=1", "--spare-nodes", "1"]


def test_the_interruption_rate_is_llama_3s_per_node_hour() -> None:
    from scripts.cost_lib import interruptions

    # "The Llama 3 Herd of Models" (Meta, 2024), section 3.3.4, Table 5: 419 unexpected
    # interruptions in a 54-day snapshot on 16,384 H100 GPUs, 8 to a server.
    assert interruptions.LLAMA3_NODE_HOURS == 2048 * 54 * 24 == 2_654_208
    rate = interruptions.LLAMA3_RATE_PER_NODE_HOUR
    assert rate == pytest.approx(1.5786e-4, rel=1e-3)  # one interruption per 6,335 node-hours
    assert "419 unexpected interruptions in 54 days on 16,384 GPUs" in interruptions.RATE_SOURCE


def test_a_spare_saves_the_replacement_minus_the_supervisors_share(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = run_json(capsys, "--nodes", "256", *SPARE_ARGS)
    s = report["spares"]
    # The supervisor's defaults (2P + G + R = 960 s) against a 26 s launch and the 45-minute
    # bootstrap bound: 1,766 s less waiting per death.
    assert s["supervisor_retry_seconds"] == 960
    assert s["replacement_seconds"] == 26 + 2700
    assert s["saved_seconds_per_death"] == 1766
    assert s["expected_deaths"] == pytest.approx(s["interruptions_per_node_hour"] * 256 * 240)
    assert s["hours_saved"] == pytest.approx(s["expected_deaths"] * 1766 / 3600)
    assert s["spare_node_hours"] == pytest.approx(240)
    price = table_price("trn1.32xlarge")
    assert s["cost_with_spares_usd"] == pytest.approx(257 * price * 240)
    assert s["cost_without_spares_usd"] == pytest.approx(256 * price * (240 + s["hours_saved"]))
    assert s["net_saving_usd"] > 0  # at 256 nodes one spare pays for itself


def test_spares_pay_only_above_the_break_even_rate(capsys: pytest.CaptureFixture[str]) -> None:
    small = run_json(capsys, "--nodes", "64", *SPARE_ARGS)["spares"]
    assert small["net_saving_usd"] < 0  # at Llama 3's rate, 64 nodes meet too few deaths
    rate = small["break_even_rate_per_node_hour"]
    assert rate == pytest.approx(1 / (64 * 64 * 1766 / 3600))
    at = run_json(capsys, "--nodes", "64", *SPARE_ARGS, "--interruptions-per-node-hour", str(rate))[
        "spares"
    ]
    assert at["net_saving_usd"] == pytest.approx(0, abs=0.01)
    assert at["rate_source"] == "given"
    text = run_text(capsys, "--nodes", "64", *SPARE_ARGS)
    assert "they cost more than they save" in text
    assert "The Llama 3 Herd of Models" in text


def test_a_spare_saves_nothing_where_the_replacement_is_quicker_than_the_retry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = run_json(capsys, "--nodes", "8", *SPARE_ARGS, "--replacement-seconds", "600")["spares"]
    assert s["saved_seconds_per_death"] == 0
    assert s["break_even_rate_per_node_hour"] is None
    assert s["net_saving_usd"] < 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint-every-seconds", "1800"],
         "--checkpoint-every-seconds needs --checkpoint-save-seconds (how long a save takes)"),
        (["--interruptions-per-node-hour", "1e-4"], "--interruptions-per-node-hour needs"),
        (["--checkpoint-save-seconds", "0"], "expected a number > 0, got '0'"),
    ],
)  # fmt: skip
def test_bad_checkpoint_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    try:
        code = ec.main([*CHECKPOINT_RUN[:-2], *args])
    except SystemExit as exit:  # argparse's refusal
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and message in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interruptions-per-node-hour", "0.001"], "--interruptions-per-node-hour needs"),
        (["--spare-nodes", "0"], "argument --spare-nodes: expected a whole number >= 1"),
    ],
)
def test_bad_spare_input_is_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    try:
        status = ec.main(["--seconds", "3600", "--compare", "p5.48xlarge=1", *args])
    except SystemExit as exit_:  # argparse's own refusal
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
