"""The node image custom resource: the newest Neuron DLAMI of the release the stack names.

CloudFormation calls this handler when it creates the resource and again only when the
resource's properties change (a new release in scripts/node/neuron_releases.json), so the image
it answers stays the launch template's image across later deploys. It finds the image the way
the Neuron DLAMI User Guide's "Finding a DLAMI for a specific Neuron SDK version" does (EC2
DescribeImages by owner, name and the SDK version in the description: Neuron publishes SSM
parameters for the latest DLAMI only), x86_64 and available, deprecated images included (a
DLAMI past its deprecation date still launches), and answers the one created last; an update
keeps the image in use while it still matches (a rollback gets back the image it had). None: the
deploy fails with one line naming the filters and the region. Standard library and boto3 only
(the Lambda Python runtime's); the response goes to CloudFormation's pre-signed URL
(CloudFormation User Guide, "Custom resource response objects").
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import boto3
from botocore.exceptions import ClientError

#: The properties the stack passes (stacks/node_image.py), all required.
PROPERTIES = ("Release", "Owner", "NameFilter", "DescriptionFilter", "Architecture")


def ec2_client() -> Any:
    """EC2 in the function's own region, which is the stack's (the tests replace this)."""
    return boto3.client("ec2")


def _images(ec2: Any, properties: dict[str, Any], **request: Any) -> list[dict[str, Any]]:
    """Every image matching the properties (and `request`, e.g. ImageIds), all pages."""
    missing = [name for name in PROPERTIES if not properties.get(name)]
    if missing:
        raise ValueError(f"the node image resource lacks the properties {', '.join(missing)}")
    filters = [
        {"Name": "name", "Values": [properties["NameFilter"]]},
        {"Name": "description", "Values": [properties["DescriptionFilter"]]},
        {"Name": "architecture", "Values": [properties["Architecture"]]},
        {"Name": "state", "Values": ["available"]},
    ]
    images: list[dict[str, Any]] = []
    paginator = ec2.get_paginator("describe_images")
    for page in paginator.paginate(
        Owners=[properties["Owner"]], Filters=filters, IncludeDeprecated=True, **request
    ):
        images.extend(page.get("Images", []))
    return images


def newest_image(ec2: Any, properties: dict[str, Any]) -> dict[str, Any]:
    """The image created last among those matching the properties; LookupError if none."""
    images = _images(ec2, properties)
    if not images:
        raise LookupError(
            f"no image of Neuron {properties['Release']} in {ec2.meta.region_name}: EC2 "
            f"DescribeImages with owner {properties['Owner']}, name "
            f"'{properties['NameFilter']}', description '{properties['DescriptionFilter']}', "
            f"architecture {properties['Architecture']}, state available found none; pin an "
            "image of a training release with ami=ami-... (docs/deploy.md, 'The node image')"
        )
    # CreationDate is ISO 8601 in UTC ("2026-03-02T10:11:12.000Z"): its text sorts by time.
    return max(images, key=lambda image: (image.get("CreationDate", ""), image["ImageId"]))


def image_for(ec2: Any, properties: dict[str, Any], current: str) -> dict[str, Any]:
    """On an update, the image in use while it still matches the properties (a rollback, or a
    change that is not the release's, keeps it); otherwise the newest match."""
    if current.startswith("ami-"):
        try:
            kept = _images(ec2, properties, ImageIds=[current])
        except ClientError as error:  # deregistered: InvalidAMIID.NotFound / .Unavailable
            if not error.response.get("Error", {}).get("Code", "").startswith("InvalidAMIID"):
                raise
            kept = []
        if kept:
            return kept[0]
    return newest_image(ec2, properties)


def handler(event: dict[str, Any], context: Any) -> None:
    """CloudFormation's request in, its response to the pre-signed URL out (never raises)."""
    status, reason, data = "SUCCESS", "", {}
    physical_id = event.get("PhysicalResourceId") or ""
    try:
        if event["RequestType"] in ("Create", "Update"):
            current = physical_id if event["RequestType"] == "Update" else ""
            image = image_for(ec2_client(), event["ResourceProperties"], current)
            physical_id = image["ImageId"]
            data = {
                "ImageId": image["ImageId"],
                "Name": image.get("Name", ""),
                "CreationDate": image.get("CreationDate", ""),
            }
            print(f"node image: {physical_id} {data['Name']} ({image.get('Description', '')})")
    except Exception as error:  # every failure becomes the deploy's one-line reason
        status, reason = "FAILED", str(error) or type(error).__name__
        print(f"node image: {reason}")
    respond(event, status, reason, physical_id or context.log_stream_name, data)


def respond(
    event: dict[str, Any], status: str, reason: str, physical_id: str, data: dict[str, str]
) -> None:
    body = json.dumps(
        {
            "Status": status,
            "Reason": reason[:1000],
            "PhysicalResourceId": physical_id,
            "StackId": event["StackId"],
            "RequestId": event["RequestId"],
            "LogicalResourceId": event["LogicalResourceId"],
            "Data": data,
        }
    ).encode()
    request = urllib.request.Request(
        event["ResponseURL"],
        data=body,
        method="PUT",
        headers={"Content-Type": "", "Content-Length": str(len(body))},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
