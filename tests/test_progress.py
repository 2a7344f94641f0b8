"""A job's progress from its metrics file (docs/job-contract.md): the schema and its validator
(scripts/cluster_lib/progress.py), the reference trainer's lines, the CloudWatch agent's entry
that ships the file, the logs stand-in that serves it as the agent would, and what `cluster.py
jobs` shows from it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import botocore.session
import pytest
from botocore.validate import validate_parameters

from scripts.cluster_lib.progress import PHASES, Record, read, summarize
from tests.node_support import FakeNode
from tests.workload_support import TINY, make_data, run_train

REPO = Path(__file__).resolve().parent.parent
INSTANCE = "i-0000000000000000a"
GROUP = "/trainium-cluster/rehearsal/training"


# ------------------------------------------------------------------------------ schema
BAD_LINES = [
    ("step 10/100 loss 0.3", "not JSON (Expecting value)"),
    ("[1, 2]", "a list, not a JSON object"),
    ('{"total_steps": 10}', "no 'step': every line needs the step as an integer >= 0"),
    ('{"step": "10"}', "'step' is '10': use an integer >= 0"),
    ('{"step": true}', "'step' is True: use an integer >= 0"),
    ('{"step": -1}', "'step' is -1: use an integer >= 0"),
    ('{"step": 1.5}', "'step' is 1.5: use an integer >= 0"),
    ('{"step": 1, "total_steps": "100"}', "'total_steps' is '100': use an integer >= 0 or null"),
    ('{"step": 1, "time": "now"}', "'time' is 'now': use unix seconds (a number)"),
    ('{"step": 1, "phase": "warmup"}',
     "'phase' is 'warmup': use one of compiling, training, saving, evaluating"),
    ('{"step": 1, "metrics": [0.3]}', "'metrics' is [0.3]: use an object of name -> number"),
    ('{"step": 1, "metrics": {"loss": "0.3"}}', "metric 'loss' is '0.3': use a finite number"),
    ('{"step": 1, "metrics": {"loss": null}}', "metric 'loss' is None: use a finite number"),
    ('{"step": 1, "metrics": {"loss": NaN}}',
     "NaN is not JSON: use a finite number or leave the metric out"),
    ('{"step": 1, "metrics": {"loss": Infinity}}',
     "Infinity is not JSON: use a finite number or leave the metric out"),
    ('{"step": 1, "stpe": 2}',
     "unknown key 'stpe': allowed step, total_steps, time, phase, metrics"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "why"), BAD_LINES)
def test_a_bad_line_is_named_in_one_line_and_skipped(line: str, why: str) -> None:
    good = '{"step": 5, "total_steps": 10, "time": 100.5, "phase": "training", "metrics": {}}'
    records, errors = read(["", good, line, good])
    assert errors == [f"line 3: {why}; skipped"]
    assert records == [Record(5, 10, 100.5, "training", {})] * 2


def test_every_documented_phase_and_a_bare_step_are_valid() -> None:
    lines = [json.dumps({"step": 3, "phase": phase}) for phase in PHASES] + ['{"step": 0}']
    records, errors = read(lines)
    assert errors == []
    assert [r.phase for r in records] == [*PHASES, None]


def test_the_validator_command_names_each_bad_line_without_a_traceback(tmp_path: Path) -> None:
    metrics = tmp_path / "job.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2, "phase": "warmup"}\nnot json\n{"step": 3}\n')
    result = subprocess.run(
        [sys.executable, "-m", "scripts.cluster_lib.progress", str(metrics)],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"{metrics}: line 2: 'phase' is 'warmup': use one of compiling, training, saving, "
        "evaluating; skipped",
        f"{metrics}: line 3: not JSON (Expecting value); skipped",
    ]
    assert result.stdout == f"{metrics}: 2 valid lines, 2 bad\n"
    missing = subprocess.run(
        [sys.executable, "-m", "scripts.cluster_lib.progress", str(tmp_path / "none.jsonl")],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert missing.returncode == 2
    assert (
        missing.stderr == f"{tmp_path / 'none.jsonl'}: cannot read it (No such file or directory)\n"
    )


# ------------------------------------------------------------------------ what jobs shows
def test_rate_and_eta_come_from_the_last_run_of_rising_steps() -> None:
    """A retry resumes from an earlier checkpoint: the steps before it are not the rate."""
    records = [
        Record(100, 1000, 1000.0, "training", {"loss": 0.9}),
        Record(200, 1000, 1100.0, "training", {"loss": 0.8}),
        Record(150, 1000, 4000.0, "compiling"),  # resumed from step 150: compiling first
        Record(150, 1000, 5000.0, "training", {"loss": 0.85}),
        Record(250, 1000, 5050.0, "training", {"loss": 0.7}),
        Record(250, 1000, 5060.0, "evaluating", {"eval_accuracy": 0.75}),
    ]
    progress = summarize(records)
    assert progress.step == "250/1000"
    assert progress.rate == "1.67/s"  # (250 - 150) / (5060 - 5000)
    assert progress.eta == "7m30s"  # 750 steps at 100/60 a second
    assert progress.metrics == "eval_accuracy=0.75 loss=0.7"
    assert summarize([Record(7)]).step == "7"
    assert summarize([Record(10, 10, 1.0), Record(10, 10, 2.0)]).eta == "done"
    assert summarize([]).step == "-"


# --------------------------------------------------------------- the reference trainer
def test_the_reference_trainers_progress_lines_follow_the_schema(tmp_path: Path) -> None:
    """train.py (workload/metrics.py) writes TRAINIUM_METRICS_FILE in the schema, besides its
    own OUTPUT/metrics.jsonl: a line per logged step and per evaluation."""
    data = make_data(tmp_path / "data", train=64, test=32)
    progress = tmp_path / "log" / "metrics" / "job.jsonl"
    result = run_train(
        [*TINY, "--data", str(data), "--output", str(tmp_path / "out"), "--max-steps", "6",
         "--batch-size", "8", "--log-every", "2", "--eval-every", "3", "--device", "cpu",
         "--checkpoint-every", "6"],
        extra_env={"TRAINIUM_METRICS_FILE": str(progress)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records, errors = read(progress.read_text().splitlines())
    assert errors == []
    # A line when a phase begins (compiling before the first steps and the first evaluation,
    # saving before a checkpoint, evaluating before a later evaluation), and one with the
    # metrics after each logged step and evaluation.
    assert [(r.step, r.phase) for r in records] == [
        (0, "compiling"), (2, "training"), (3, "compiling"), (3, "evaluating"), (4, "training"),
        (6, "training"), (6, "evaluating"), (6, "evaluating"), (6, "saving"),
    ]  # fmt: skip
    assert {r.total_steps for r in records} == {6}
    assert [r.metrics for r in records if r.phase in ("compiling", "saving")] == [{}, {}, {}]
    assert {"loss", "lr", "samples_per_second"} <= set(records[1].metrics)
    assert {"eval_loss", "eval_accuracy"} <= set(records[-2].metrics)
    own = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["event"] for m in own if m["event"] in ("train", "eval")] == [
        "train", "eval", "train", "train", "eval",
    ]  # fmt: skip


# ---------------------------------------------------------- the CloudWatch agent's entry
def agent_entries() -> dict[str, str]:
    """bootstrap.sh phase_monitoring's collect_list under $LOG_DIR: folder -> wildcard, as
    the agent's configuration names them (file_path) with stream {instance_id}/<folder>."""
    text = (REPO / "scripts/node/bootstrap.sh").read_text()
    found = re.findall(
        r'"file_path": "\$LOG_DIR/([a-z]+)/([^"]+)",[^}]*'
        r'"log_stream_name": "\{instance_id\}/([a-z]+)"',
        text,
    )
    assert all(folder == stream for folder, _, stream in found)
    return {folder: wildcard for folder, wildcard, _ in found}


def test_the_logs_stand_in_ships_the_folders_the_agent_config_names() -> None:
    from scripts.rehearsal.logs_stand_in import AGENT_FOLDERS

    assert agent_entries()["metrics"] == "*.jsonl"
    assert agent_entries() == AGENT_FOLDERS


def test_launch_gives_the_job_its_metrics_file_and_leg_deadline(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    args = ["--hosts", "10.1.0.12", "--job-id", "bert-1", "--nproc-per-node", "2", "--dry-run"]
    result = node.run("launch.sh", *args, "--time-limit", "7200", "--stop-grace", "600")
    assert result.returncode == 0, result.stderr
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line[:40])
    assert env["TRAINIUM_METRICS_FILE"] == f"{node.logs}/metrics/bert-1.jsonl"
    started = int(datetime.now(UTC).timestamp())
    assert 0 <= started + 6600 - int(env["TRAINIUM_LEG_DEADLINE"]) <= 60
    unlimited = node.run("launch.sh", *args)
    assert "TRAINIUM_LEG_DEADLINE=0" in unlimited.stdout.splitlines()
    precompile = node.run("launch.sh", *args, "--log-folder", "precompile")
    assert "TRAINIUM_METRICS_FILE=" not in precompile.stdout


# ------------------------------------------------------------------- jobs, end to end
class _Instances:
    """What LogsStandIn reads of the rehearsal's instances: their IDs and upper folders."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cluster_name = "rehearsal"
        self.instances = [SimpleNamespace(instance_id=INSTANCE)]

    def upper(self, instance: Any, path: str) -> Path:
        return self.root / path.strip("/")


class _LogsClient:
    """GetLogEvents answered by the logs stand-in, its request checked against botocore's
    logs model as the real client would."""

    def __init__(self, stand_in: Any) -> None:
        self.stand_in = stand_in
        self.model = botocore.session.get_session().get_service_model("logs")

    def get_log_events(self, **params: Any) -> dict[str, Any]:
        validate_parameters(params, self.model.operation_model("GetLogEvents").input_shape)
        answer: dict[str, Any] = self.stand_in._logs_GetLogEvents(params)
        return answer


def test_jobs_shows_step_rate_eta_and_metrics_from_rank_0s_metrics_stream(
    tmp_path: Path,
) -> None:
    """Rank 0's node file, shipped by the (stand-in) agent to <instance-id>/metrics, read by
    `jobs` as the job's window of that stream: a bad line among them is skipped."""
    from scripts.cluster_lib.fleet import Node
    from scripts.cluster_lib.jobs import JobRow, Jobs, rows_text
    from scripts.cluster_lib.logs import Logs
    from scripts.rehearsal.logs_stand_in import LogsStandIn

    folder = tmp_path / "var/log/trainium-cluster/metrics"
    folder.mkdir(parents=True)
    lines = [
        {"step": 10, "total_steps": 400, "time": 1000.0, "phase": "training",
         "metrics": {"loss": 0.71, "lr": 2e-3}},
        "step 20/400 loss 0.69 (a log line is no progress)",
        {"step": 30, "total_steps": 400, "time": 1010.0, "phase": "training",
         "metrics": {"loss": 0.52, "lr": 1.9e-3}},
        {"step": 30, "total_steps": 400, "time": 1012.0, "phase": "evaluating",
         "metrics": {"eval_accuracy": 0.8125}},
        {"step": 40, "total_steps": 400, "time": 1020.0, "phase": "training",
         "metrics": {"loss": 0.43, "lr": 1.8e-3}},
    ]  # fmt: skip
    (folder / "bert-1.jsonl").write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    os.utime(folder / "bert-1.jsonl", (2000, 2000))
    ssm = SimpleNamespace(instances=_Instances(tmp_path), commands={})
    stand_in = LogsStandIn(ssm)  # type: ignore[arg-type]
    logs = Logs(_LogsClient(stand_in), None, print)  # type: ignore[arg-type]
    jobs = object.__new__(Jobs)
    jobs.cluster = SimpleNamespace(  # type: ignore[assignment]
        outputs=lambda: {"TrainingLogGroupName": GROUP}, logs=logs
    )
    node = Node(INSTANCE, "10.1.0.12", "use1-az6", "running")

    progress = jobs._progress(node, (1_000_000, None))

    assert progress.step == "40/400"
    assert progress.rate == "1.5/s"  # 30 steps in 20 s
    assert progress.eta == "4m00s"  # 360 steps at 1.5 a second
    assert progress.metrics == "eval_accuracy=0.8125 loss=0.43 lr=0.0018"
    # The window is the job's: an earlier job's lines (before its command) are not read.
    assert jobs._progress(node, (3_000_000, None)).step == "-"
    row = JobRow("bert-1", "RUNNING", datetime(2026, 11, 22, tzinfo=UTC), "1h00m",
                 progress=progress)  # fmt: skip
    header, line = rows_text([row])
    assert header.split()[-5:] == ["STEP", "RATE", "ETA", "COST", "METRICS"]
    assert line.split()[-7:] == [
        "40/400", "1.5/s", "4m00s", "-", "eval_accuracy=0.8125", "loss=0.43", "lr=0.0018"
    ]  # fmt: skip
