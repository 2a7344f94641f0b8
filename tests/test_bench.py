"""The throughput benchmark (workload/bench.py) on the CPU: tiny model, a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.skips import not_applicable
from workload import bench, bench_rounds
from workload.bench_device import dynamo_stats
from workload.bench_paths import StepRunner
from workload.bench_rounds import synthetic_batches, train_config, useful_tokens_per_sample
from workload.bench_stats import kernel_kind

REPO = Path(__file__).resolve().parent.parent
STEPS, ROUNDS, BATCH, SEQ, FILL = 3, 2, 4, 32, 0.5


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
        *("--fill", str(FILL), "--profile-steps", "1"),
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
        # One timed block per round; its step time is the block's mean.
        assert r["steps"] == STEPS * ROUNDS
        assert len(r["step_seconds"]) == ROUNDS
        assert r["step_ms_min"] <= r["step_ms_p10"] <= r["step_ms_median"]
        assert r["step_ms_median"] <= r["step_ms_p90"] <= r["step_ms_max"]
        assert r["samples_per_second"] == pytest.approx(BATCH * 1000 / r["step_ms_median"])
        assert r["tokens_per_second"] == pytest.approx(r["samples_per_second"] * SEQ)
        assert r["samples_per_second_mean"] == pytest.approx(
            BATCH * ROUNDS / sum(r["step_seconds"]), rel=1e-3
        )
        # Half the positions or more are real text; the rest is padding.
        useful = r["useful_tokens_per_second"] / r["samples_per_second"]
        assert FILL * SEQ <= useful < SEQ
        assert r["dynamo_graphs"] is None or r["dynamo_graphs"] == 0  # no torch.compile on CPU
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
    assert report["fill"] == FILL
    assert "one device wait" in report["timing"]
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
    assert "| model | path | samples/s | tokens/s | useful tokens/s |" in stdout  # README table
    assert "Traceback" not in stdout
    assert report["plot"] == "bench.png"
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    import matplotlib.image

    height, width = matplotlib.image.imread(out / "bench.png").shape[:2]
    assert width >= 400 and height >= 150
    for path in ("trainer", "plain"):  # --profile-steps: the profiler's table per path
        text = (out / f"profile-tiny-{path}.txt").read_text()
        summary = json.loads(text[: text.index("\n\n")])
        assert summary["steps"] == 1 and summary["wall_ms_per_step"] > 0
        assert "aten::" in text
        assert _results(report)[path]["profile"] == summary


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--model huge", "argument --model: invalid choice: 'huge'"),
        ("--steps 0", "argument --steps: expected a whole number >= 1, got '0'"),
        ("--paths trainer,fast", "expected a comma-separated list of trainer, plain, hf-trainer"),
        ("--model bert-base --task causal-lm", "--task applies to --model tiny only"),
        ("--fill 0", "argument --fill: expected a number in (0, 1], got '0'"),
        ("--fill 1.5", "argument --fill: expected a number in (0, 1], got '1.5'"),
        ("--device cuda", "--device cuda"),
    ],
)
def test_bad_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], args: str, message: str
) -> None:
    if "cuda" in args and torch.cuda.is_available():
        not_applicable("this machine has a CUDA device")
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
    # Timed as one block: the host traced step 2 while the device could still run step 1.
    assert trainer["steps"] == 2 and len(trainer["step_seconds"]) == 1
    assert trainer["compile_seconds"] > 0
    assert trainer["features"][1].endswith("AdamW")
    assert "fused" not in trainer["features"][1]  # fused is CPU/CUDA only
    assert hf["status"] == "skipped" and "optimum-neuron" in hf["reason"]
    assert "compiles (warm-up+timed)" in stdout


# -- units -------------------------------------------------------------------------------------


class _Backend:
    """Records the order of steps and waits (the calls StepRunner makes on a backend)."""

    kind = "cpu"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.events: list[str] = []

    def wait(self) -> None:
        self.events.append("wait")


def test_a_timed_block_waits_for_the_device_only_at_its_edges() -> None:
    """The host queues step after step, as the trainer does (no wait per step)."""
    backend = _Backend()
    model = nn.Linear(2, 2)
    runner = StepRunner(
        backend,  # type: ignore[arg-type]
        lambda batch: backend.events.append("step"),
        [{"x": torch.zeros(1)}],
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    seconds = runner.run(4, skip=2)
    assert seconds >= 0
    assert backend.events == ["step", "step", "wait", *["step"] * 4, "wait"]


_HF_BLOCK = """
import json, sys
from pathlib import Path
from workload import bench
from workload.backend import setup_backend
from workload.bench_paths import HfTrainerRunner, hf_trainer_unavailable
from workload.bench_rounds import _CORPUS, synthetic_batches, train_config
from workload.model import build_model, train_tiny_tokenizer

out = Path(sys.argv[1])
args = bench.build_parser().parse_args(["--device", "cpu", "--batch-size", "2", "--seq-len", "16"])
config = train_config(bench.bench_options(args), "tiny", out)
tokenizer = train_tiny_tokenizer(_CORPUS, config.task, vocab_size=200)
backend = setup_backend("cpu", "fp32")
reason = hf_trainer_unavailable(backend)
if reason:
    print(json.dumps({"skip": reason}))
    sys.exit(0)
model = build_model(config, tokenizer)
batches = synthetic_batches(config, int(model.config.vocab_size), 2, count=2)
runner = HfTrainerRunner(backend, model, config, batches, out / "hf")
waits = []
backend.wait = lambda: waits.append(1)
seconds = runner.run(3, skip=1)
print(json.dumps({"seconds": seconds, "waits": len(waits)}))
"""


def test_hf_trainer_block_waits_only_at_its_edges(tmp_path: Path) -> None:
    """Run in a process of its own: accelerate decides at import whether to use torch-xla."""
    pytest.importorskip("accelerate")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"} | {"USE_TORCH_XLA": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _HF_BLOCK, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["seconds"] > 0
    assert result["waits"] == 2  # before the first timed step and after the last


@pytest.mark.parametrize("task", ["classification", "causal-lm"])
def test_synthetic_batches_pad_like_text(task: str, tmp_path: Path) -> None:
    args = bench.build_parser().parse_args(["--batch-size", "64", "--seq-len", "40"])
    args.task = task
    config = train_config(bench.bench_options(args), "tiny", tmp_path)
    batches = synthetic_batches(config, 500, 2, count=3, fill=0.25, pad_id=7)
    for batch in batches:
        mask = batch["attention_mask"]
        lengths = mask.sum(dim=1)
        assert lengths.min() >= 10 and lengths.max() <= 40  # ceil(0.25 * 40) .. 40
        assert (mask[:, :10] == 1).all()  # padding only after the text
        assert (batch["input_ids"][mask == 0] == 7).all()
        if task == "causal-lm":
            assert (batch["labels"][mask == 0] == -100).all()
            assert (batch["labels"][mask == 1] == batch["input_ids"][mask == 1]).all()
    masks = torch.cat([b["attention_mask"] for b in batches])
    useful = useful_tokens_per_sample(batches)
    assert useful == pytest.approx(float(masks.sum()) / masks.shape[0])
    assert 10 < useful < 40
    full = synthetic_batches(config, 500, 2, count=1)
    assert useful_tokens_per_sample(full) == 40


def test_dynamo_counts_graphs_breaks_and_recompiles() -> None:
    """The counters are torch's own: a graph break and a recompilation really happen."""

    def f(x: Any) -> Any:
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    before = dynamo_stats()
    compiled = torch.compile(f, backend="eager")
    compiled(torch.ones(3))
    compiled(torch.ones(3))  # same guards: nothing new
    mid = dynamo_stats()
    compiled(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: recompile
    after = dynamo_stats()
    assert mid["graphs"] - before["graphs"] == 2  # split in two by the break
    assert sum(mid["breaks"].values()) - sum(before["breaks"].values()) == 1
    assert len(after["recompiles"]) > len(mid["recompiles"])
    assert after["graphs"] > mid["graphs"]


@pytest.mark.parametrize(
    ("name", "kind"),
    [  # kernel names from the H100 profile of BERT-base (README)
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
        ("void cudnn::fusion::compute_dot_do_o_specialized<true>", "attention"),
        (
            "triton_per_fused__to_copy_add_native_dropout_native_layer_norm_0",
            "inductor fused (triton)",
        ),
        (
            "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>",
            "optimizer",
        ),
        (
            "void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor>",
            "multi-tensor (grad norm, clip, zero)",
        ),
        ("void at::native::reduce_kernel<128, 4>", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind


def test_out_of_memory_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def oom(*_: Any, **__: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.20 GiB.\nmore")

    monkeypatch.setattr(bench_rounds, "measure", oom)
    args = "--device cpu --paths trainer --batch-size 48 --seq-len 16 --output"
    assert bench.main([*args.split(), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "batch 48 x 16 does not fit in device memory (CUDA out of memory." in err
    assert "use a smaller --batch-size" in err
