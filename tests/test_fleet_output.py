"""The scale rehearsal's simulated invocations carry what real ones carry: the most output the
SSM agent keeps. ListCommandInvocations' `Output` (botocore CommandPlugin.Output) holds at most
2,500 characters, stdout and stderr joined and each cut with the agent's truncation mark
(iohandler.go: MaximumPluginOutputSize, truncateOut, truncateError); GetCommandInvocation's
StandardOutputContent at most 24,000 (pluginutil.go StringPrefix with its suffix). An
invocation with no output would keep the supervisor's payloads smaller than AWS's."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.fleet import (
    FAKE_TORCHRUN,
    SimulatedAgents,
    SimulatedHosts,
    SimulatedInstances,
    _Real,
    _Running,
)
from scripts.rehearsal.ssm_agent import MAX_STDOUT_LENGTH
from scripts.rehearsal.ssm_agent.runscript import (
    MAXIMUM_PLUGIN_OUTPUT_SIZE,
    OUTPUT_TRUNCATED_SUFFIX,
    TRUNCATE_ERROR,
    TRUNCATE_OUT,
)


def test_a_simulated_invocation_ends_with_the_most_output_the_agent_keeps(tmp_path: Path) -> None:
    hosts = SimulatedHosts(2)
    with LocalCloud(hosts, tmp_path, instances=SimulatedInstances) as cloud:  # type: ignore[arg-type]
        agents = SimulatedAgents(cloud.instances)  # type: ignore[arg-type]
        try:
            agents.attach(cloud)
            ssm = cloud.client("ssm")
            ids = [i.instance_id for i in cloud.running()]
            command = ssm.send_command(
                DocumentName="rehearsal-StopTraining", InstanceIds=ids,
                Parameters={"JobId": ["scale"]},
            )["Command"]  # fmt: skip
            pages = ssm.get_paginator("list_command_invocations").paginate(
                CommandId=command["CommandId"], Details=True
            )
            invocations = list(
                itertools.chain.from_iterable(p["CommandInvocations"] for p in pages)
            )
            assert [i["Status"] for i in invocations] == ["Success", "Success"], invocations
            for invocation in invocations:
                (plugin,) = invocation["CommandPlugins"]
                output = plugin["Output"]
                assert len(output.encode()) == MAXIMUM_PLUGIN_OUTPUT_SIZE, len(output)
                assert TRUNCATE_OUT in output and output.endswith(TRUNCATE_ERROR), output[-80:]
                full = ssm.get_command_invocation(
                    CommandId=command["CommandId"], InstanceId=invocation["InstanceId"]
                )
                stdout = full["StandardOutputContent"]
                assert len(stdout) == MAX_STDOUT_LENGTH and stdout.endswith(OUTPUT_TRUNCATED_SUFFIX)
        finally:
            agents.close()


def test_a_real_nodes_torchrun_reads_the_status_it_is_told_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scale rehearsal's real nodes run torchrun's stand-in (FAKE_TORCHRUN), which exits with
    what <command>.exit holds as soon as the file exists. The status is written whole and then
    renamed into place: a file created before its text is written reads empty, and `exit ""` is
    status 2 (launch.sh then reports 1: a 1,024-node job failed that way on a busy machine).
    Here every write is slowed: the file is created empty, and its text follows after the
    stand-in has had 10 looks at it (or has exited)."""
    command_id = str(uuid.uuid4())
    script = tmp_path / "torchrun"
    script.write_text(FAKE_TORCHRUN)
    script.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "REHEARSAL_NODE_DIR": str(tmp_path),
           "SSM_COMMAND_ID": command_id}  # fmt: skip
    torchrun = subprocess.Popen([script, "--nnodes", "1"], env=env)
    written = Path.write_text

    def slowly(path: Path, text: str, *args: object, **kwargs: object) -> int:
        path.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            torchrun.wait(timeout=2)  # the stand-in looks every 0.2 s
        return written(path, text)

    instance = SimpleNamespace(instance_id="i-0000000000000000a", state="running", root=tmp_path)
    invocation = SimpleNamespace(instance=instance, folder=tmp_path)
    idle = SimpleNamespace(poll=lambda: None, kill=lambda: None)
    agents = SimulatedAgents(instances=None)  # type: ignore[arg-type]
    try:
        key = f"{command_id}-{instance.instance_id}"
        agents.real[key] = _Real(key, command_id, invocation, idle, 0.0)  # type: ignore[arg-type]
        agents.wait_launched(1, 60)  # its torchrun reported its start
        monkeypatch.setattr(Path, "write_text", slowly)
        agents.fail(instance, 7)  # type: ignore[arg-type]
        monkeypatch.undo()
        assert torchrun.wait(timeout=60) == 7
    finally:
        agents.close()
        torchrun.kill()


def test_finish_ends_the_simulated_nodes_once_the_real_ones_have_exited(tmp_path: Path) -> None:
    """`finish` tells the real nodes' torchrun to exit 0 and ends the simulated invocations only
    once every real script has exited: a simulated invocation ends at once, and the first of a
    batch to end starts the supervisor's FailureGraceSeconds for the rest (5 s in the scale
    rehearsal), after which it cancels the rest. Ended together, a real node slower than that
    on a busy machine was cancelled, and the 1,024-node job failed ("RunTraining ended
    Cancelled"). Here the real script exits only when the test lets it, after looking at the
    simulated node's status."""
    command_id = str(uuid.uuid4())
    exited = threading.Event()
    script = SimpleNamespace(poll=lambda: 0 if exited.is_set() else None, kill=lambda: None)
    real_node = SimpleNamespace(instance_id="i-0000000000000000a", state="running", root=tmp_path)
    real_folder = tmp_path / "real"
    real_folder.mkdir()
    real_invocation = SimpleNamespace(instance=real_node, folder=real_folder)
    simulated = SimpleNamespace(
        instance_id="i-0000000000000000b", state="running", address="10.0.0.2"
    )
    simulated_folder = tmp_path / "simulated"
    simulated_folder.mkdir()
    agents = SimulatedAgents(instances=None)  # type: ignore[arg-type]
    real_key = f"{command_id}-{real_node.instance_id}"
    simulated_key = f"{command_id}-{simulated.instance_id}"
    try:
        agents.real[real_key] = _Real(real_key, command_id, real_invocation, script, 0.0)  # type: ignore[arg-type]
        (tmp_path / f"{command_id}.started").touch()  # its torchrun reported its start
        agents.wait_launched(1, 60)
        with agents._changed:
            agents.running[simulated_key] = _Running(
                simulated_folder,
                simulated,
                "scale-RunTraining",
                0.0,  # type: ignore[arg-type]
            )
        finishing = threading.Thread(target=agents.finish)
        finishing.start()
        told = tmp_path / f"{command_id}.exit"
        deadline = time.monotonic() + 60
        while not told.exists():
            assert time.monotonic() < deadline, "the real node was never told to exit"
            time.sleep(0.05)
        assert told.read_text() == "0\n"
        # Told, and its script still runs: the simulated node has not ended.
        assert not (simulated_folder / "status.json").exists()
        exited.set()
        finishing.join(timeout=60)
        assert not finishing.is_alive()
        real = json.loads((real_folder / "status.json").read_text())
        ended = json.loads((simulated_folder / "status.json").read_text())
        assert (real["status"], ended["status"]) == ("Success", "Success")
        assert real["ended"] <= ended["ended"]
    finally:
        agents.close()
