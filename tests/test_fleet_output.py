"""The scale rehearsal's simulated invocations carry what real ones carry: the most output the
SSM agent keeps. ListCommandInvocations' `Output` (botocore CommandPlugin.Output) holds at most
2,500 characters, stdout and stderr joined and each cut with the agent's truncation mark
(iohandler.go: MaximumPluginOutputSize, truncateOut, truncateError); GetCommandInvocation's
StandardOutputContent at most 24,000 (pluginutil.go StringPrefix with its suffix). An
invocation with no output would keep the supervisor's payloads smaller than AWS's."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
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
