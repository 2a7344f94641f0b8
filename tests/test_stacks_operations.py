"""Operations stack: SSM documents from stacks/ssm_documents, logs, dashboard, alarms, outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.cluster_lib.outputs import EXPORT_OUTPUTS, REQUIRED_OUTPUTS
from tests.cdk_support import Synth, alternative, flatten, only_resource, resources, synth

SSM_DOCUMENTS_DIR = Path(__file__).resolve().parent.parent / "stacks" / "ssm_documents"
CONTRACT_OUTPUTS = (
    "ClusterName",
    "ClusterTagKey",
    "NodeCount",
    "InstanceType",
    "AutoScalingGroupName",
    "RunTrainingDocumentName",
    "PreflightDocumentName",
    "PrecompileDocumentName",
    "StopTrainingDocumentName",
    "TrainingLogGroupName",
    "DataBucketName",
    "CheckpointBucketName",
    "CompileCacheBucketName",
    "FsxMountName",
    "FsxDnsName",
    "AlarmTopicArn",
    "DashboardName",
    "FileSystemId",
    "ExportPaths",
    "LifecycleHookName",
)
AUTO_SCALING_SERVICE_ROLE = (
    "arn:{partition}:iam::{account}:role/aws-service-role/autoscaling.amazonaws.com/"
    "AWSServiceRoleForAutoScaling"
)


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def test_every_yaml_file_becomes_a_command_document(default: Synth) -> None:
    template = default.templates["operations"]
    files = sorted(SSM_DOCUMENTS_DIR.glob("*.yaml"))
    assert {p.stem for p in files} >= {"RunTraining", "Preflight", "Precompile", "StopTraining"}
    documents = resources(template, "AWS::SSM::Document")
    assert set(documents) == {f"{p.stem}Document" for p in files}
    for path in files:
        props = documents[f"{path.stem}Document"]["Properties"]
        assert props["DocumentType"] == "Command"
        assert "Name" not in props  # named by CloudFormation; operators read the outputs
        assert props["Content"] == yaml.safe_load(path.read_text())


def test_outputs_carry_what_the_operator_tooling_reads(default: Synth) -> None:
    outputs = default.templates["operations"]["Outputs"]
    assert set(CONTRACT_OUTPUTS) <= set(outputs)
    # What scripts/cluster.py refuses to run without must be there too.
    assert set(REQUIRED_OUTPUTS) <= set(outputs)
    assert set(EXPORT_OUTPUTS) <= set(outputs)  # `cluster.py export` (contract C6)
    assert outputs["ClusterName"]["Value"] == "trainium"
    assert outputs["ClusterTagKey"]["Value"] == "trainium-cluster:name"
    assert outputs["NodeCount"]["Value"] == "2"
    assert outputs["InstanceType"]["Value"] == "trn1.32xlarge"
    assert outputs["AutoScalingGroupName"]["Value"] == "trainium-workers"
    assert outputs["RunTrainingDocumentName"]["Value"] == {"Ref": "RunTrainingDocument"}
    assert "LustreMountName" in flatten(outputs["FsxMountName"]["Value"])
    assert outputs["LifecycleHookName"]["Value"] == "trainium-bootstrap"


def test_outputs_name_what_to_export_before_destroy(default: Synth) -> None:
    """The CLI's export before destroy: a data repository task on these paths of this file
    system; the paths are exactly the associations' (relative to the file system root)."""
    template = default.templates["operations"]
    outputs = template["Outputs"]
    storage = default.templates["storage"]
    (file_system_id,) = resources(storage, "AWS::FSx::FileSystem")
    associations = resources(storage, "AWS::FSx::DataRepositoryAssociation").values()
    paths = [a["Properties"]["FileSystemPath"] for a in associations]
    # The compile cache's association is left out: its bucket goes with the stack, and a cache
    # is rebuilt by compiling again.
    assert paths == ["/data", "/jobs", "/neuron-compile-cache"]
    assert outputs["ExportPaths"]["Value"].split(",") == ["/data", "/jobs"]
    imported = outputs["FileSystemId"]["Value"]["Fn::ImportValue"]
    export = next(
        o for o in storage["Outputs"].values() if o.get("Export", {}).get("Name") == imported
    )
    assert export["Value"] == {"Ref": file_system_id}


def test_log_groups_are_encrypted_with_retention(default: Synth) -> None:
    """The training log group and the execution log groups of the job supervisor, of the job
    queue's dispatcher and of the supervisor's wake."""
    groups = resources(default.templates["operations"], "AWS::Logs::LogGroup")
    owners = sorted(re.sub(r"(ExecutionLogGroup|LogGroup)[0-9A-F]{8}$", "", g) for g in groups)
    assert owners == ["JobDispatcher", "JobSupervisor", "JobSupervisorWake", "Training"]
    for group in groups.values():
        assert group["Properties"]["RetentionInDays"] == 365
        assert "OperationsKey" in flatten(group["Properties"]["KmsKeyId"])
        assert group["DeletionPolicy"] == "Retain"


def test_alarm_topic_is_encrypted_and_tls_only(default: Synth) -> None:
    template = default.templates["operations"]
    topic = only_resource(template, "AWS::SNS::Topic")["Properties"]
    assert "OperationsKey" in flatten(topic["KmsMasterKeyId"])
    policy = only_resource(template, "AWS::SNS::TopicPolicy")["Properties"]["PolicyDocument"]
    assert any(
        s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        for s in policy["Statement"]
    )
    assert not resources(template, "AWS::SNS::Subscription")


def test_alarm_email_subscribes_to_the_topic() -> None:
    alternative().template("operations").has_resource_properties(
        "AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": "ops@example.com"}
    )


def test_auto_scaling_notifications_key_grant_names_the_service_linked_role(
    default: Synth,
) -> None:
    key = only_resource(default.templates["operations"], "AWS::KMS::Key")
    statements = key["Properties"]["KeyPolicy"]["Statement"]
    for statement in statements:
        assert statement["Principal"] not in ("*", {"AWS": "*"}), statement
    grant = next(s for s in statements if s.get("Sid") == "AllowAutoScalingNotifications")
    principal = flatten(grant["Principal"]["AWS"])
    assert principal == AUTO_SCALING_SERVICE_ROLE.format(
        partition="aws", account='{"Ref": "AWS::AccountId"}'
    )
    assert sorted(grant["Action"]) == ["kms:Decrypt", "kms:GenerateDataKey*"]


def test_bootstrap_failures_raise_an_alarm(default: Synth) -> None:
    """bootstrap.sh puts BootstrapFailures=1 (namespace and ClusterName dimension as in the
    contract with the node scripts); one failure in five minutes alarms."""
    template = default.templates["operations"]
    alarm = next(
        a["Properties"]
        for a in resources(template, "AWS::CloudWatch::Alarm").values()
        if "BootstrapFailures" in json.dumps(a)
    )
    metric = alarm["Metrics"][0]["MetricStat"]
    assert metric["Metric"] == {
        "Namespace": "TrainiumCluster/trainium",
        "MetricName": "BootstrapFailures",
        "Dimensions": [{"Name": "ClusterName", "Value": "trainium"}],
    }
    assert metric["Stat"] == "Sum"
    assert metric["Period"] == 300
    assert alarm["Threshold"] == 1
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert alarm["TreatMissingData"] == "notBreaching"


def test_alarms_notify_the_topic(default: Synth) -> None:
    template = default.templates["operations"]
    alarms = resources(template, "AWS::CloudWatch::Alarm")
    assert len(alarms) == 4
    (topic_id,) = resources(template, "AWS::SNS::Topic")
    for alarm in alarms.values():
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": topic_id}]
    metrics = {}
    for alarm in alarms.values():
        props = alarm["Properties"]
        # An alarm on a labelled metric is rendered as a one-query metric math alarm.
        for query in props.get("Metrics", [props]):
            metric = query["MetricStat"]["Metric"] if "MetricStat" in query else query
            if "MetricName" in metric:
                metrics[metric["MetricName"]] = (props, metric)
    props, metric = metrics["GroupInServiceInstances"]
    assert metric["Dimensions"] == [{"Name": "AutoScalingGroupName", "Value": "trainium-workers"}]
    assert set(metrics) == {"GroupInServiceInstances", "GroupDesiredCapacity",
                            "StatusCheckFailed", "FreeDataStorageCapacity",
                            "BootstrapFailures"}  # fmt: skip


def _nodes_missing_alarm_fires(props: dict[str, Any], desired: float, in_service: float) -> bool:
    """Evaluates the alarm's metric math expression for one data point."""
    queries = {q["Id"]: q for q in props["Metrics"]}
    (expression,) = [q for q in props["Metrics"] if q.get("ReturnData", True) and "Expression" in q]
    values = {}
    for query_id, query in queries.items():
        if "MetricStat" in query:
            name = query["MetricStat"]["Metric"]["MetricName"]
            values[query_id] = {
                "GroupDesiredCapacity": desired,
                "GroupInServiceInstances": in_service,
            }[name]
    # The expression is one subtraction of two queries (metric math "a - b").
    left, right = expression["Expression"].split(" - ")
    value = values[left] - values[right]
    assert props["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    return bool(value >= props["Threshold"])


@pytest.mark.parametrize("which", ["default", "capacity-block"])
def test_nodes_missing_alarm_follows_the_desired_capacity(which: str) -> None:
    """A Capacity Block's group is empty outside the block: no alarm then. A node short of
    what the group wants alarms in every mode."""
    synthesized = synth() if which == "default" else alternative()
    alarms = resources(synthesized.templates["operations"], "AWS::CloudWatch::Alarm")
    (props,) = [a["Properties"] for a in alarms.values() if "GroupDesiredCapacity" in json.dumps(a)]
    nodes = synthesized.config.node_count
    assert not _nodes_missing_alarm_fires(props, desired=0, in_service=0)
    assert not _nodes_missing_alarm_fires(props, desired=nodes, in_service=nodes)
    assert _nodes_missing_alarm_fires(props, desired=nodes, in_service=nodes - 1)
    assert props["EvaluationPeriods"] == 3


def test_dashboard_shows_neuroncores_cpu_network_and_fsx(default: Synth) -> None:
    dashboard = only_resource(default.templates["operations"], "AWS::CloudWatch::Dashboard")
    body = flatten(dashboard["Properties"]["DashboardBody"])
    assert """SEARCH('Namespace=\\"TrainiumCluster/trainium\\" utilization'""" in body
    for metric in ("CPUUtilization", "NetworkIn", "NetworkOut", "DataReadBytes", "DataWriteBytes"):
        assert f'"{metric}"' in body, metric
    json.loads(json.dumps(body))  # the body is one string CloudWatch parses
