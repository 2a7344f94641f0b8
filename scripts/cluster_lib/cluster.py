"""`Cluster`: one deployed cluster, its parts composed, and the operator's verbs on it.

Each part is a module of its own and talks to the AWS services it names:

- arguments.py: what the CLI checks in its arguments before any AWS call (no AWS);
- documents.py: the SSM documents in stacks/ssm_documents/, their parameter checks (no AWS);
- clients.py: the boto3 clients, AWS errors as one line, `Patience` (polling, riding out
  throttling and time-outs);
- outputs.py: the operations stack's outputs (CloudFormation);
- fleet.py: the nodes, their SSM status and software, the launch template, `roll` (EC2, SSM,
  Auto Scaling);
- commands.py: send a document to the nodes in batches of 50, follow it, cancel it (SSM);
- command_history.py: the commands SSM ran with the stack's documents (SSM);
- logs.py: the nodes' command output (CloudWatch Logs);
- node_operations.py: preflight (and the software check), precompile, stop;
- storage.py: `export` of the FSx file system to S3 (FSx);
- jobs.py and executions.py: jobs under the job supervisor (Step Functions), built on a Cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scripts.cluster_lib.clients import DEFAULT_GIVE_UP_AFTER, Clients, Patience
from scripts.cluster_lib.command_history import CommandHistory
from scripts.cluster_lib.commands import RunCommand
from scripts.cluster_lib.fleet import Fleet, hosts
from scripts.cluster_lib.logs import Logs
from scripts.cluster_lib.node_operations import NodeOperations
from scripts.cluster_lib.outputs import Stack
from scripts.cluster_lib.storage import Storage


class Cluster:
    """One deployed cluster, found through its operations stack (`<cluster_name>-operations`).

    `out` says what happens, `sleep` and `clock` keep time (the tests replace them), every
    poll waits `poll_interval` seconds; a wait for nodes or a refresh gives up after
    `wait_timeout` seconds, the other nodes of a failed command are cancelled `failure_grace`
    seconds after the first failure, and transient AWS errors are ridden out for
    `give_up_after` seconds.
    """

    def __init__(
        self,
        clients: Clients,
        cluster_name: str,
        *,
        out: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_interval: float = 10.0,
        wait_timeout: float = 900.0,
        failure_grace: float = 120.0,
        tail_lines: int = 40,
        give_up_after: float = DEFAULT_GIVE_UP_AFTER,
    ) -> None:
        self.clients = clients
        self.cluster_name = cluster_name
        self.patience = Patience(out, sleep, clock, poll_interval, give_up_after)
        self.stack = Stack(clients.cloudformation, cluster_name)
        self.logs = Logs(clients.logs, self.stack, out)
        self.history = CommandHistory(clients.ssm, self.stack, self.patience)
        self.fleet = Fleet(
            clients, self.stack, self.patience, self.history, wait_timeout=wait_timeout
        )
        self.commands = RunCommand(
            clients.ssm, self.stack, self.patience, self.logs,
            failure_grace=failure_grace, tail_lines=tail_lines,
        )  # fmt: skip
        self.node_operations = NodeOperations(
            cluster_name, clients.ssm, self.patience,
            fleet=self.fleet, commands=self.commands, history=self.history, logs=self.logs,
        )  # fmt: skip
        self.storage = Storage(clients.fsx, self.stack, self.patience)

        # The operator's verbs, each served by the part that holds it.
        self.outputs = self.stack.outputs
        self.running_nodes = self.fleet.running_nodes
        self.wait_for_nodes = self.fleet.wait_for_nodes
        self.launch_template = self.fleet.launch_template
        self.wait_for_refresh = self.fleet.wait_for_refresh
        self.roll = self.fleet.roll
        self.hosts = hosts
        self.run = self.commands.run
        self.latest_commands = self.history.latest_commands
        self.preflight = self.node_operations.preflight
        self.precompile = self.node_operations.precompile
        self.stop = self.node_operations.stop
        self.export = self.storage.export
