"""The default node image: the Neuron DLAMI of the table's training release, found once.

The rule-holders: the Neuron DLAMI User Guide ("Finding a DLAMI for a specific Neuron SDK
version": EC2 DescribeImages by owner, name and the SDK version in the description; SSM
parameters name only the latest DLAMI, frozen at Neuron 2.31, which no longer trains), botocore's
ec2 model (the Stubber checks every request against DescribeImages' input shape and every answer
against its output shape), and CloudFormation's custom resource contract (the response PUT to
the pre-signed URL: Status, Reason, PhysicalResourceId, StackId, RequestId, LogicalResourceId,
Data). The handler runs in-process on a real ec2 client; its answers are images named as the
synthesized resource's filters ask.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import boto3
import pytest
from botocore.stub import Stubber

from stacks.config import DEFAULT_AMI_PARAMETER
from stacks.node_image import RELEASE_TABLE, RESOURCE_TYPE, image_properties
from stacks.node_image_handler import index as handler_module
from tests.cdk_support import Synth, synth

REGION = "us-east-1"
TABLE = json.loads(RELEASE_TABLE.read_text())


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def _resources(synthesized: Synth, kind: str) -> dict[str, Any]:
    template = synthesized.templates["compute"]
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


def _image_resource(synthesized: Synth) -> tuple[str, dict[str, Any]]:
    ((logical_id, resource),) = _resources(synthesized, RESOURCE_TYPE).items()
    return logical_id, resource


def _launch_image(synthesized: Synth) -> Any:
    ((template),) = _resources(synthesized, "AWS::EC2::LaunchTemplate").values()
    return template["Properties"]["LaunchTemplateData"]["ImageId"]


def _properties(synthesized: Synth) -> dict[str, Any]:
    """The resource's properties as CloudFormation passes them to the handler."""
    properties = dict(_image_resource(synthesized)[1]["Properties"])
    properties.pop("ServiceToken")
    return properties


def _image(image_id: str, created: str, release: str = "2.29.1") -> dict[str, Any]:
    """One DescribeImages entry of the table's DLAMI, named as Neuron names them."""
    return {
        "ImageId": image_id,
        "Name": f"{TABLE['image']['name']} {created[:10].replace('-', '')}",
        "Description": f"Supported EC2 instances: Trn1, Trn1n, Trn2. Neuron SDK {release} ...",
        "CreationDate": created,
        "Architecture": "x86_64",
        "State": "available",
        "OwnerId": "898082745236",
        "ImageOwnerAlias": "amazon",
        "Public": True,
        "ImageType": "machine",
    }


def _expected_request(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "Owners": [properties["Owner"]],
        "Filters": [
            {"Name": "name", "Values": [properties["NameFilter"]]},
            {"Name": "description", "Values": [properties["DescriptionFilter"]]},
            {"Name": "architecture", "Values": ["x86_64"]},
            {"Name": "state", "Values": ["available"]},
        ],
        "IncludeDeprecated": True,
    }


@pytest.fixture
def ec2() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client(
        "ec2", region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


# The template -----------------------------------------------------------------------------


def test_the_default_launches_the_image_the_custom_resource_found(default: Synth) -> None:
    assert default.config.ami == "neuron-release"
    logical_id, resource = _image_resource(default)
    assert _launch_image(default) == {"Fn::GetAtt": [logical_id, "ImageId"]}
    # No SSM parameter: nothing can move the image between deploys.
    parameters = default.templates["compute"].get("Parameters", {}).values()
    assert not [p for p in parameters if "AWS::EC2::Image::Id" in p["Type"]]
    ((function_id, function),) = _resources(default, "AWS::Lambda::Function").items()
    assert resource["Properties"]["ServiceToken"] == {"Fn::GetAtt": [function_id, "Arn"]}
    assert function["Properties"]["Handler"] == "index.handler"


def test_the_resource_carries_the_tables_release_and_filters(default: Synth) -> None:
    """A new release in neuron_releases.json changes the properties: CloudFormation updates
    the resource, which finds that release's image; otherwise it keeps the image it found."""
    image = TABLE["image"]
    assert _properties(default) == {
        "Release": image["neuron"],
        "Owner": image["owner"],
        "NameFilter": image["name_filter"],
        "DescriptionFilter": image["description_filter"],
        "Architecture": "x86_64",
    }
    assert set(_properties(default)) == set(handler_module.PROPERTIES)
    (release,) = [row for row in TABLE["releases"] if row["neuron"] == image["neuron"]]
    assert release["training"], "the default image must be of a release that trains"


def test_another_release_in_the_table_gives_other_properties(tmp_path: Path) -> None:
    table = json.loads(RELEASE_TABLE.read_text())
    table["image"].update(neuron="2.29.0", description_filter="*Neuron SDK 2.29.0*")
    path = tmp_path / "neuron_releases.json"
    path.write_text(json.dumps(table))
    assert image_properties(path)["Release"] == "2.29.0"
    assert image_properties(path)["DescriptionFilter"] == "*Neuron SDK 2.29.0*"
    assert image_properties(path) != image_properties()


def test_the_handler_may_only_describe_images_and_write_its_log(default: Synth) -> None:
    role_id = next(iter(_resources(default, "AWS::Lambda::Function").values()))["Properties"][
        "Role"
    ]["Fn::GetAtt"][0]
    (policy,) = [
        p for p in _resources(default, "AWS::IAM::ManagedPolicy").values()
        if {"Ref": role_id} in p["Properties"].get("Roles", [])
    ]  # fmt: skip
    statements = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    assert statements["FindImage"]["Action"] == "ec2:DescribeImages"
    assert statements["FindImage"]["Resource"] == "*"
    assert statements["WriteLog"]["Action"] == ["logs:CreateLogStream", "logs:PutLogEvents"]
    assert statements.keys() == {"FindImage", "WriteLog"}


def test_a_pinned_ami_bypasses_the_look_up() -> None:
    pinned = synth(ami="ami-0123456789abcdef0")
    assert _launch_image(pinned) == "ami-0123456789abcdef0"
    assert not _resources(pinned, RESOURCE_TYPE)
    assert not _resources(pinned, "AWS::Lambda::Function")


def test_an_ssm_parameter_is_resolved_at_deploy_time() -> None:
    synthesized = synth(ami=DEFAULT_AMI_PARAMETER)
    parameter = synthesized.templates["compute"]["Parameters"][_launch_image(synthesized)["Ref"]]
    assert parameter["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    assert parameter["Default"] == DEFAULT_AMI_PARAMETER
    assert not _resources(synthesized, RESOURCE_TYPE)


# The handler ------------------------------------------------------------------------------


def test_the_newest_matching_image_is_chosen(default: Synth, ec2: tuple[Any, Stubber]) -> None:
    client, stubber = ec2
    properties = _properties(default)
    older = _image("ami-0aaaaaaaaaaaaaaa1", "2026-03-02T10:11:12.000Z")
    newest = _image("ami-0bbbbbbbbbbbbbbb2", "2026-04-20T08:00:00.000Z")
    middle = _image("ami-0ccccccccccccccc3", "2026-03-30T23:59:59.000Z")
    stubber.add_response(
        "describe_images",
        {"Images": [older, newest], "NextToken": "page-2"},
        _expected_request(properties),
    )
    stubber.add_response(
        "describe_images",
        {"Images": [middle]},
        {**_expected_request(properties), "NextToken": "page-2"},
    )
    assert handler_module.newest_image(client, properties)["ImageId"] == newest["ImageId"]


def test_no_matching_image_fails_with_one_line(default: Synth, ec2: tuple[Any, Stubber]) -> None:
    client, stubber = ec2
    properties = _properties(default)
    stubber.add_response("describe_images", {"Images": []}, _expected_request(properties))
    with pytest.raises(LookupError) as raised:
        handler_module.newest_image(client, properties)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"no image of Neuron {TABLE['image']['neuron']} in {REGION}: ")
    for value in (properties["NameFilter"], properties["DescriptionFilter"], "x86_64", "amazon"):
        assert value in message
    assert "ami=ami-..." in message


class _CloudFormation(http.server.BaseHTTPRequestHandler):
    """The pre-signed response URL: records each PUT body."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_PUT(self) -> None:
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def response_url() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    _CloudFormation.bodies = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _CloudFormation)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/response", _CloudFormation.bodies
    finally:
        server.shutdown()
        server.server_close()


class _Context:
    log_stream_name = "2026/11/25/[$LATEST]0123456789abcdef"


def _event(request_type: str, url: str, default: Synth, **extra: Any) -> dict[str, Any]:
    logical_id, resource = _image_resource(default)
    return {
        "RequestType": request_type,
        "ResponseURL": url,
        "StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/trainium-compute/x",
        "RequestId": "5a1d4f2e-0000-4000-8000-000000000001",
        "ResourceType": resource["Type"],
        "LogicalResourceId": logical_id,
        "ResourceProperties": {**resource["Properties"], "ServiceToken": "arn:aws:lambda:..."},
        **extra,
    }


def _run(event: dict[str, Any], bodies: list[dict[str, Any]]) -> dict[str, Any]:
    handler_module.handler(event, _Context())
    (body,) = bodies
    assert {k: body[k] for k in ("StackId", "RequestId", "LogicalResourceId")} == {
        k: event[k] for k in ("StackId", "RequestId", "LogicalResourceId")
    }
    return body


def test_create_answers_the_newest_image(
    default: Synth,
    ec2: tuple[Any, Stubber],
    response_url: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, stubber = ec2
    url, bodies = response_url
    monkeypatch.setattr(handler_module, "ec2_client", lambda: client)
    images = [
        _image("ami-0aaaaaaaaaaaaaaa1", "2026-03-02T10:11:12.000Z"),
        _image("ami-0bbbbbbbbbbbbbbb2", "2026-04-20T08:00:00.000Z"),
    ]
    request = _expected_request(_properties(default))
    stubber.add_response("describe_images", {"Images": images}, request)
    body = _run(_event("Create", url, default), bodies)
    assert body["Status"] == "SUCCESS"
    assert body["PhysicalResourceId"] == "ami-0bbbbbbbbbbbbbbb2"
    assert body["Data"]["ImageId"] == "ami-0bbbbbbbbbbbbbbb2"


@pytest.mark.parametrize("current", ["of another release", "deregistered"])
def test_a_new_release_finds_its_newest_image(
    current: str,
    default: Synth,
    ec2: tuple[Any, Stubber],
    response_url: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An update whose image no longer matches (the table's release changed) finds anew."""
    client, stubber = ec2
    url, bodies = response_url
    monkeypatch.setattr(handler_module, "ec2_client", lambda: client)
    request = _expected_request(_properties(default))
    old = "ami-0aaaaaaaaaaaaaaa1"
    if current == "deregistered":
        stubber.add_client_error(
            "describe_images",
            service_error_code="InvalidAMIID.NotFound",
            service_message=f"The image id '[{old}]' does not exist",
            expected_params={**request, "ImageIds": [old]},
        )
    else:
        stubber.add_response("describe_images", {"Images": []}, {**request, "ImageIds": [old]})
    newest = _image("ami-0bbbbbbbbbbbbbbb2", "2026-04-20T08:00:00.000Z")
    stubber.add_response("describe_images", {"Images": [newest]}, request)
    body = _run(_event("Update", url, default, PhysicalResourceId=old), bodies)
    assert body["Status"] == "SUCCESS"
    assert body["PhysicalResourceId"] == body["Data"]["ImageId"] == newest["ImageId"]


def test_an_update_keeps_the_image_while_it_matches(
    default: Synth,
    ec2: tuple[Any, Stubber],
    response_url: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rollback to the old release, or a change that is not the release's: the image in use
    stays, though a newer one of the release exists (no second call: the Stubber refuses it)."""
    client, stubber = ec2
    url, bodies = response_url
    monkeypatch.setattr(handler_module, "ec2_client", lambda: client)
    request = _expected_request(_properties(default))
    old = _image("ami-0aaaaaaaaaaaaaaa1", "2026-03-02T10:11:12.000Z")
    stubber.add_response(
        "describe_images", {"Images": [old]}, {**request, "ImageIds": [old["ImageId"]]}
    )
    body = _run(_event("Update", url, default, PhysicalResourceId=old["ImageId"]), bodies)
    assert body["Status"] == "SUCCESS"
    assert body["PhysicalResourceId"] == body["Data"]["ImageId"] == old["ImageId"]


def test_a_failed_look_up_fails_the_deploy_with_its_reason(
    default: Synth,
    ec2: tuple[Any, Stubber],
    response_url: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, stubber = ec2
    url, bodies = response_url
    monkeypatch.setattr(handler_module, "ec2_client", lambda: client)
    request = _expected_request(_properties(default))
    stubber.add_response("describe_images", {"Images": []}, request)
    handler_module.handler(_event("Create", url, default), _Context())
    (body,) = bodies
    assert body["Status"] == "FAILED"
    assert body["Reason"].startswith("no image of Neuron 2.29.1 in us-east-1: ")
    assert body["PhysicalResourceId"] == _Context.log_stream_name


def test_delete_calls_nothing(
    default: Synth,
    ec2: tuple[Any, Stubber],
    response_url: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, _ = ec2  # no response queued: any EC2 call would fail the Stubber
    url, bodies = response_url
    monkeypatch.setattr(handler_module, "ec2_client", lambda: client)
    handler_module.handler(
        _event("Delete", url, default, PhysicalResourceId="ami-0bbbbbbbbbbbbbbb2"), _Context()
    )
    (body,) = bodies
    assert body["Status"] == "SUCCESS"
    assert body["PhysicalResourceId"] == "ami-0bbbbbbbbbbbbbbb2"


def test_the_documented_failure_is_the_handlers(default: Synth) -> None:
    """docs/deploy.md shows the line a region without the image fails the deploy with."""
    client = boto3.client(
        "ec2", region_name="eu-west-1", aws_access_key_id="testing", aws_secret_access_key="t"
    )
    properties = _properties(default)
    with Stubber(client) as stubber:
        stubber.add_response("describe_images", {"Images": []}, _expected_request(properties))
        with pytest.raises(LookupError) as raised:
            handler_module.newest_image(client, properties)
    docs = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()
    assert f"\n{raised.value}\n" in docs
