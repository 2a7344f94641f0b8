"""Fault rehearsals: faults a week-long job meets, run through the job supervisor's synthesized
state machine (moto's interpreter) and the Run Command stand-in's nodes
(scripts/rehearsal/aws_stand_in.py, instances.py), each ending with the job finished from its
last checkpoint, or stopped with the checkpoint it was asked for, and no process of the job
left on any node.

- `stop` while the trainers' save takes longer than torchrun's 30 s before SIGKILL: the save
  ends and the checkpoint is there.
- One job that meets, in turn: the OOM killer (SIGKILL from outside the agent) on one node's
  torchrun and on the other's trainer; then, on its retry, one node losing an EFA device while
  the other is rebooted and its bootstrap fails. The attempt with the OOM kills fails with
  status 1 on both nodes (never TimedOut: the agent reports 137 so), the retry resumes from
  the last checkpoint; the next retry's preflight finds the lost device and the failed
  bootstrap and exits 3 on both nodes, which the supervisor replaces; the job finishes on the
  new nodes from the last checkpoint.

The trainers hold at known steps (TRAINIUM_HOLD_AFTER_STEP, workload/stop.py) while a fault is
dealt: nothing races the training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.documents import join_train_args
from scripts.rehearsal.instances import Instance, Killed
from tests.cdk_support import Synth
from tests.node_support import unique_job_id
from tests.test_rehearsal import (
    HOLD_AT_5,
    Cli,
    checkpoints,
    gone,
    held,
    job_metrics,
    sample_data,
    short_legs,
    stand_in,
    train_args,
    wait_for,
)
from tests.test_supervisor import FAST, default, supervised
from workload.stop import HOLD_VARIABLE

__all__ = ["default", "sample_data", "short_legs"]  # fixtures shared here

#: How long the rehearsal makes the checkpoint save take: longer than the 30 s torch 2.9's
#: torchrun gives its workers between SIGTERM and SIGKILL (elastic/multiprocessing/api.py,
#: SubprocessContext._close(timeout=30)), shorter than StopTraining's 120 s grace.
SLOW_SAVE_SECONDS = 35

#: A rehearsal device, NOT part of the workload: on the nodes' PYTHONPATH (the rehearsal's
#: node settings put it there), this sitecustomize wraps workload.checkpoint.save_checkpoint
#: once that module is imported, so that every save first waits SLOW_SAVE_SECONDS (or, with
#: REHEARSAL_SAVE_GATE, until the test makes that file), then saves; it logs when each save began
#: and ended to the file named by REHEARSAL_SLOW_SAVE_LOG. It stands for a large model's save to
#: FSx; workload/ itself is untouched.
SLOW_SAVE_SITECUSTOMIZE = '''
"""Rehearsal device (tests/test_fault_rehearsals.py): every checkpoint save takes longer."""
import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time

TARGET = "workload.checkpoint"


def record(event, step):
    with open(os.environ["REHEARSAL_SLOW_SAVE_LOG"], "a") as log:
        log.write(json.dumps({"event": event, "step": step, "time": time.time()}) + "\\n")


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        save = module.save_checkpoint

        @functools.wraps(save)
        def slow_save(output, step, *args, **kwargs):
            record("began", step)
            gate = os.environ.get("REHEARSAL_SAVE_GATE")
            if gate:
                deadline = time.monotonic() + 900  # an upper bound only
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.2)
            else:
                time.sleep(float(os.environ["REHEARSAL_SLOW_SAVE_SECONDS"]))
            path = save(output, step, *args, **kwargs)
            record("ended", step)
            return path

        module.save_checkpoint = slow_save


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("REHEARSAL_SLOW_SAVE_SECONDS") or os.environ.get("REHEARSAL_SAVE_GATE"):
    sys.meta_path.insert(0, _Finder())
'''


def slow_saves(tmp_path: Path, gate: Path | None = None) -> dict[str, str]:
    """Node settings that slow every checkpoint save by SLOW_SAVE_SECONDS, or hold it until
    `gate` exists (the sitecustomize above, in a folder the nodes see); the saves are logged to
    tmp_path/slow-saves.jsonl."""
    site = tmp_path / "rehearsal-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SAVE_SITECUSTOMIZE)
    held = {"REHEARSAL_SAVE_GATE": str(gate)} if gate is not None else {}
    return {
        "PYTHONPATH": str(site),
        "REHEARSAL_SLOW_SAVE_SECONDS": str(SLOW_SAVE_SECONDS),
        "REHEARSAL_SLOW_SAVE_LOG": str(tmp_path / "slow-saves.jsonl"),
        **held,
    }


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_stop_lets_the_trainers_finish_a_save_longer_than_30_s(
    tmp_path: Path,
    sample_data: Path,
    default: Synth,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """`cluster.py stop` (StopTraining, stop.sh with its 120 s grace) while the trainers hold
    after step 5 with no checkpoint yet: the stop's save takes SLOW_SAVE_SECONDS (a rehearsal
    device, SLOW_SAVE_SITECUSTOMIZE), longer than the 30 s torchrun gives its workers after a
    SIGTERM. The save must end: the job stops at step 5 with its checkpoint, and nothing of
    the job is left. (Before stop.sh signalled the workers first, torchrun SIGKILLed them in
    the middle of that save: no checkpoint, no summary.)"""
    from scripts.rehearsal.supervisor import local_supervisor

    cluster_name, template = default.config.cluster_name, default.templates["operations"]
    job = unique_job_id("slowsave")
    args = train_args(sample_data, "--max-steps", "5000", "--checkpoint-every", "1000",
                      "--eval-every", "5000", "--log-every", "5")  # fmt: skip
    settings = {**HOLD_AT_5, **slow_saves(tmp_path)}
    with (
        stand_in(tmp_path, cluster_name=cluster_name, node_settings=settings) as cloud,
        local_supervisor(cloud, template),
    ):
        train = Cli(cloud, "train", "--job-id", job, "--max-retries", "1", "--retry-delay", "1",
                    "--check-every", "1", "--detach", "--", *args)  # fmt: skip
        train.run()
        assert train.code == 0, capfd.readouterr()
        held(tmp_path, job, 5, 400, capfd.readouterr)
        assert checkpoints(tmp_path / "jobs" / job) == []  # the stop's save is the only one

        stop = Cli(cloud, "stop", "--job-id", job)
        stopped_at = time.time()
        stop.run()
        captured = capfd.readouterr()
        assert stop.code == 0, captured.out + captured.err
        assert gone(job), "a process of the job outlived the stop"

        saves = [json.loads(line) for line in slow_saves_log(tmp_path)]
        summaries = job_metrics(tmp_path, job, "summary")
        assert checkpoints(tmp_path / "jobs" / job) == [5], (
            f"the stop's save did not end: {saves}\n{captured.out}"
        )
        assert [(s["step"], s["stopped_by_signal"]) for s in summaries] == [(5, True)], summaries
        began, ended = saves
        assert (began["event"], began["step"], ended["event"]) == ("began", 5, "ended"), saves
        assert began["time"] >= stopped_at
        assert ended["time"] - began["time"] >= SLOW_SAVE_SECONDS
        stops = [c for c in cloud.commands.values() if c.document.endswith("StopTraining")]
        assert [i.status()["status"] for i in stops[0].invocations.values()] == ["Success"] * 2
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert len(legs) == 1


def slow_saves_log(tmp_path: Path) -> list[str]:
    path = tmp_path / "slow-saves.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def holds(tmp_path: Path, job: str) -> list[int]:
    return [h["step"] for h in job_metrics(tmp_path, job, "hold")]


def invocation(command: Any, instance: Instance) -> tuple[str, int]:
    status = command.invocations[instance.instance_id].status()
    return status["status"], status["code"]


def output_of(command: Any, instance: Instance) -> str:
    inv = command.invocations[instance.instance_id]
    return (inv.output("stdout") + inv.output("stderr")).decode(errors="replace")


@pytest.mark.slow
@pytest.mark.netns
def test_oom_kills_then_a_lost_efa_device_and_a_failed_bootstrap_the_job_finishes(
    tmp_path: Path, sample_data: Path, default: Synth
) -> None:
    """One two-node job, its trainers held at known steps while each fault is dealt:

    1. held after step 5 (its checkpoint saved): the OOM killer's SIGKILL, from outside the
       agent, to torchrun on node 1 and to the process it would pick on node 0 (the largest
       oom_score: a trainer). Both nodes' RunTraining must fail with status 1, a failure the
       supervisor retries, not 137 (which the SSM agent reports as TimedOut for a process it
       did not stop itself), and the retry resumes from step 5;
    2. the retry held after step 10 (its checkpoint saved): node 1 loses one of its 8 EFA
       devices and its trainer dies as the failing collective ends it; node 0 is rebooted and
       its bootstrap fails (the stand-in's agent runs the interrupted RunTraining again, as
       the SSM agent does after a reboot, and launch.sh refuses a node that is not ready).
       The next preflight must exit 3 on both nodes (replace them): 7 of 8 EFA devices, and
       the failed bootstrap; the supervisor marks both Unhealthy, the group replaces them;
    3. the job resumes from step 10 on the new nodes and finishes.

    Every expectation is checked once the job has ended, each named after its fault, so a
    run shows every fault that is not handled."""
    job = unique_job_id("faults")
    args = train_args(sample_data, "--max-steps", "15", "--checkpoint-every", "5",
                      "--eval-every", "15", "--log-every", "5")  # fmt: skip
    cluster_name = default.config.cluster_name
    problems: list[str] = []

    def expect(fault: str, ok: bool, detail: Any) -> None:
        if not ok:
            problems.append(f"{fault}: {detail}")

    with supervised(tmp_path, default, node_settings=dict(HOLD_AT_5)) as (cloud, supervisor):
        execution = supervisor.start(job, TrainArgs=join_train_args(args), MaxRetries=3, **FAST)

        def trace() -> str:
            return supervisor.trace(execution)

        held(tmp_path, job, 5, 400, trace)
        assert checkpoints(tmp_path / "jobs" / job) == [5]
        first, second = cloud.running()
        # The retry holds again after step 10 (cluster.env is read at each launch).
        cloud.instances.set_node_setting(HOLD_VARIABLE, "10")

        # 1. The OOM killer, on both nodes at once (nothing runs in between).
        oom_torchrun = cloud.instances.sigkill(second, "torchrun")
        oom_largest = cloud.instances.sigkill(first, "largest")
        assert "torchrun" in oom_torchrun.command
        assert_trainer(oom_largest)

        wait_for("the retry holding after step 10", lambda: holds(tmp_path, job) == [5, 10],
                 600, trace)  # fmt: skip
        assert checkpoints(tmp_path / "jobs" / job)[-1] == 10

        # 2. A lost EFA device on node 1 (its collective fails: its trainer dies) and a reboot
        # of node 0 whose bootstrap then fails.
        lost = cloud.instances.remove_efa_device(second)
        collective = cloud.instances.sigkill(second, "largest")
        assert_trainer(collective)
        cloud.instances.reboot(
            first,
            bootstrap_error="libfabric has no EFA provider: multi-node training needs the EFA "
            "interfaces",
        )
        status = supervisor.wait(execution, 900)

        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        preflights = [c for c in cloud.commands.values() if c.document.endswith("Preflight")]
        resumes = [r["step"] for r in job_metrics(tmp_path, job, "resume")]

        # 1. The OOM kills: status 1 on both nodes, and the retry resumed from step 5.
        ended = invocation(legs[0], second)
        expect("OOM-killed torchrun (node 1)", ended == ("Failed", 1), f"RunTraining {ended}")
        ended = invocation(legs[0], first)
        expect("OOM-killed trainer (node 0)", ended == ("Failed", 1), f"RunTraining {ended}")
        expect("OOM kills", resumes[:1] == [5], f"the retry resumed from {resumes}")

        # 2. The retry: node 1's trainer died with its collective; node 0's agent ran the
        # interrupted RunTraining again after the reboot, which launch.sh refused. Then the
        # last preflight of each node exits 3, naming the fault.
        ended = invocation(legs[1], second)
        expect("lost EFA device (node 1)", ended == ("Failed", 1), f"RunTraining {ended}")
        ended, said = invocation(legs[1], first), output_of(legs[1], first)
        expect(
            "failed bootstrap (node 0)",
            ended == ("Failed", 1) and "this node is not ready" in said,
            f"RunTraining after the reboot {ended}: {said[-800:]}",
        )
        (efa,) = [p for p in preflights if second.instance_id in p.invocations][-1:]
        ended, said = invocation(efa, second), output_of(efa, second)
        expect(
            "lost EFA device (node 1)",
            ended == ("Failed", 3) and "FAIL efa: found 7 EFA devices, expected 8" in said,
            f"the preflight after the loss of {lost} {ended}:\n{said[-1500:]}",
        )
        (boot,) = [p for p in preflights if first.instance_id in p.invocations][-1:]
        ended, said = invocation(boot, first), output_of(boot, first)
        expect(
            "failed bootstrap (node 0)",
            ended == ("Failed", 3) and "FAIL ready: bootstrap failed: " in said,
            f"the preflight after the reboot {ended}:\n{said[-1500:]}",
        )
        reports = sorted(cloud.health_reports)
        expected = sorted((i.instance_id, "Unhealthy") for i in (first, second))
        expect("replaced nodes", reports == expected, f"health reports {reports}")

        # 3. The job finished from step 10 on two new nodes; nothing of it is left.
        expect("the job", status == "SUCCEEDED", f"ended {status}\n{supervisor.trace(execution)}")
        expect("the job", resumes == [5, 10], f"resumed from {resumes}, not [5, 10]")
        trained = [r["step"] for r in job_metrics(tmp_path, job, "train")]
        expect("the job", max(trained, default=0) == 15, f"trained to {trained}")
        last = set(legs[-1].invocations)
        new_nodes = {i.instance_id for i in cloud.running()}
        expect("the job", last == new_nodes and not last & {first.instance_id, second.instance_id},
               f"the last attempt ran on {sorted(last)}")  # fmt: skip
        expect("leftovers", gone(job), "a process of the job outlived it")
        subjects = [
            n["Subject"].removeprefix(f"{cluster_name}: job {job} ") for n in cloud.notifications
        ]
        expect("notifications", subjects == ["started", *["retries"] * 3, "finished"], subjects)
        # The third retry's notice names both replaced nodes.
        notice = cloud.notifications[3]["Message"] if len(subjects) == 5 else ""
        named = [f"{i.instance_id}: Preflight" in notice for i in (first, second)]
        expect("notifications", all(named) and "(status 3: " in notice, notice)
        assert not problems, "\n".join(problems)


def assert_trainer(killed: Killed) -> None:
    """The process killed is a trainer (the job's entry point under torchrun: by default
    `python -m workload.train` from the job's code snapshot), not torchrun itself."""
    words = killed.command.split()
    assert any(w.endswith("train.py") or w == "workload.train" for w in words), killed
    assert not any(w.rsplit("/", 1)[-1] == "torchrun" for w in words[:2]), killed


def test_the_stand_ins_fi_info_lists_each_efa_device_as_fi_info_does(tmp_path: Path) -> None:
    """The nodes' fake fi_info prints one block per device of its devices file, in the form
    `fi_info -p efa -t FI_EP_RDM` prints on an EFA instance, and fails as fi_info does once no
    device is left (libfabric util/info.c: print_short_info; run prints fi_getinfo's error,
    main returns -ret)."""
    import subprocess

    from scripts.rehearsal.instances import EFA_DEVICES, FAKE_FI_INFO

    devices = tmp_path / "devices"
    script = tmp_path / "fi_info"
    script.write_text(FAKE_FI_INFO.replace(EFA_DEVICES, str(devices)))
    devices.write_text("rdmap0s0\nrdmap1s0\n")

    def fi_info(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", str(script), *args], capture_output=True, text=True,
                              check=False)  # fmt: skip

    listed = fi_info("-p", "efa", "-t", "FI_EP_RDM")
    assert listed.returncode == 0, listed.stderr
    block = "provider: efa\n    fabric: efa\n    domain: {}-rdm\n    version: 122.0\n"
    block += "    type: FI_EP_RDM\n    protocol: FI_PROTO_EFA\n"
    assert listed.stdout == block.format("rdmap0s0") + block.format("rdmap1s0")
    assert "domain: rdmap0s0-dgrm" in fi_info("-p", "efa").stdout
    devices.write_text("")
    gone_all = fi_info("-p", "efa", "-t", "FI_EP_RDM")
    assert (gone_all.returncode, gone_all.stdout) == (61, "")
    assert gone_all.stderr == "fi_getinfo: -61 (No data available)\n"


@pytest.mark.netns
def test_the_stand_ins_neuron_ls_lists_the_trainers_of_its_own_node_only(tmp_path: Path) -> None:
    """The nodes' fake neuron-ls names, as processes holding NeuronCores, the trainers in its
    own network namespace (a rehearsal node) and no other node's, nor its own grep's. Each
    node here is a network namespace of its own: other tests' trainers run in the machine's."""
    import subprocess
    import sys

    from scripts.rehearsal.instances import FAKE_NEURON_LS

    script = tmp_path / "neuron-ls"
    script.write_text(FAKE_NEURON_LS.replace("__CORES__", "2"))
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    # unshare execs the trainer in a new network namespace; nsenter the idle process in one's.
    nodes = [subprocess.Popen(["unshare", "--net", *sleep, "train.py"]) for _ in range(2)]
    started = list(nodes)
    try:
        for process in nodes:  # started: its command line reads as the trainer's
            deadline = time.monotonic() + 30
            while b"train.py" not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
                assert time.monotonic() < deadline, "the trainer did not start"
                time.sleep(0.05)
        into = [["nsenter", "--target", str(process.pid), "--net"] for process in nodes]
        started.append(subprocess.Popen([*into[0], *sleep]))

        def pids(enter: list[str]) -> list[int]:
            ls = subprocess.run([*enter, "bash", str(script), "-j"], capture_output=True,
                                text=True, check=True)  # fmt: skip
            (device,) = json.loads(ls.stdout)
            assert device["nc_count"] == 2
            return [p["pid"] for p in device["neuron_processes"]]

        assert [pids(enter) for enter in into] == [[process.pid] for process in nodes]
    finally:
        for process in started:
            process.kill()
            process.wait()
