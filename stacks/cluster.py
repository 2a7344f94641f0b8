"""The whole cluster: four stacks, one per lifecycle, wired together with keyword arguments.

Deploy order: network -> storage -> operations -> compute. The compute stack (the instances,
the only part billed by the hour) comes last, so it can be destroyed and recreated alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import aws_cdk as cdk

from stacks.compute import ComputeStack
from stacks.config import CLUSTER_TAG_KEY, ClusterConfig
from stacks.nag import add_security_checks, explain_cdk_handlers
from stacks.network import NetworkStack
from stacks.operations import OperationsStack
from stacks.storage import StorageStack


@dataclass(frozen=True)
class Cluster:
    network: NetworkStack
    storage: StorageStack
    operations: OperationsStack
    compute: ComputeStack

    @property
    def stacks(self) -> tuple[cdk.Stack, ...]:
        return (self.network, self.storage, self.operations, self.compute)


def build_cluster(app: cdk.App, config: ClusterConfig) -> Cluster:
    """Add the cluster's stacks and the cdk-nag checks to `app`."""
    # The account stays unresolved: synth needs no credentials and makes no lookups.
    env = cdk.Environment(region=config.region)
    name = config.cluster_name
    network = NetworkStack(
        app,
        config.stack_name("network"),
        config=config,
        env=env,
        description=f"{name}: VPC, cluster subnet, endpoints and security groups",
    )
    storage = StorageStack(
        app,
        config.stack_name("storage"),
        config=config,
        subnet=network.cluster_subnet,
        fsx_security_group=network.fsx_security_group,
        env=env,
        description=f"{name}: data, checkpoint and compile-cache buckets, FSx for Lustre",
    )
    operations = OperationsStack(
        app,
        config.stack_name("operations"),
        config=config,
        storage=storage,
        env=env,
        description=f"{name}: SSM documents, training logs, dashboard, alarms, outputs",
    )
    compute = ComputeStack(
        app,
        config.stack_name("compute"),
        config=config,
        subnet=network.cluster_subnet,
        efa_security_group=network.efa_security_group,
        storage=storage,
        training_log_group=operations.training_log_group,
        alarm_topic=operations.alarm_topic,
        env=env,
        description=f"{name}: {config.node_count} x {config.instance_type} training nodes",
    )
    cdk.Tags.of(app).add(CLUSTER_TAG_KEY, name)
    add_security_checks(app)
    explain_cdk_handlers(app)
    return Cluster(network=network, storage=storage, operations=operations, compute=compute)
