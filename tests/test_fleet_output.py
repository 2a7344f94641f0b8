"""The scale rehearsal's simulated invocations carry what real ones carry: the most output the
SSM agent keeps. ListCommandInvocations' `Output` (botocore CommandPlugin.Output) holds at most
2,500 characters, stdout and stderr joined and each cut with the agent's truncation mark
(iohandler.go: MaximumPluginOutputSize, truncateOut, truncateError); GetCommandInvocation's
StandardOutputContent at most 24,000 (pluginutil.go StringPrefix with its suffix). An
invocation with no output would keep the supervisor's payloads smaller than AWS's."""

from __future__ import annotations

import itertools
from pathlib import Path

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.fleet import SimulatedAgents, SimulatedHosts, SimulatedInstances
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
