"""An AWS SDK task's Parameters as Step Functions reads them, checked against botocore's model.

Step Functions' AWS SDK integrations (`arn:aws:states:::aws-sdk:<service>:<action>`) take
parameter names in PascalCase at every level, even where the service's own API is camelCase
(Step Functions developer guide, "supported-services-awssdk", API naming conventions): each
name is botocore's member name with its first letter upper-cased (SSM's CommandFilter members
`key` and `value` are written `Key` and `Value`). boto3, and so moto's interpreter, takes
botocore's names as they are, so only a check against the model with this rule sees the
difference. A field the service does not have ends the task with `States.Runtime`: "The field
"key" is not supported by Step Functions".

`problems` checks a definition's Parameters (names at every level, `.$` keys by name, and the
type of a literal value); `to_boto` checks a task's resolved Parameters and gives botocore's
names for the call.
"""

from __future__ import annotations

import functools
import re
from typing import Any

#: The Resource of an AWS SDK task: the service (Step Functions' name) and the action.
SDK_RESOURCE = re.compile(r"^arn:aws:states:::aws-sdk:(?P<service>[a-z0-9-]+):(?P<action>\w+)$")
#: Step Functions' service names where botocore's differ.
BOTO_SERVICE = {"sfn": "stepfunctions"}
#: The JSON types a literal may have for each botocore shape type.
LITERAL_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "long": (int,),
    "float": (int, float),
    "double": (int, float),
    "boolean": (bool,),
    "timestamp": (str, int, float),
    "blob": (str,),
    "structure": (dict,),
    "map": (dict,),
    "list": (list,),
}


class SdkParameterError(ValueError):
    """A Parameters field Step Functions would refuse; the message names it and the path."""


def sfn_name(member: str) -> str:
    """The name Step Functions takes for botocore's member name: first letter upper-cased."""
    return member[:1].upper() + member[1:]


@functools.cache
def _model(service: str) -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model(BOTO_SERVICE.get(service, service))


def input_shape(resource: str) -> tuple[str, str, Any]:
    """botocore's service name, operation name and input shape for an SDK task's Resource."""
    match = SDK_RESOURCE.match(resource)
    if match is None:
        raise SdkParameterError(f"{resource} is not an AWS SDK integration's resource")
    model = _model(match["service"])
    operation = model.operation_model(sfn_name(match["action"]))
    return model.service_name, operation.name, operation.input_shape


def _members(shape: Any) -> dict[str, str]:
    """A structure's members by the name Step Functions takes: name in Step Functions to
    botocore's name."""
    return {sfn_name(name): name for name in shape.members}


def _unknown(field: str, path: str, shape: Any) -> SdkParameterError:
    allowed = ", ".join(sorted(_members(shape)))
    return SdkParameterError(
        f'The field "{field}" is not supported by Step Functions (at {path}; {shape.name} '
        f"takes {allowed})"
    )


def problems(shape: Any, value: Any, path: str = "Parameters") -> list[str]:
    """What Step Functions would refuse in a definition's `value` for `shape`: each field name
    (a `.$` key by its name: its value is only known at run time), and each literal's type."""
    if shape is None:
        return [f"{path}: the action takes no parameters"] if value else []
    kind = shape.type_name
    wrong_bool = kind != "boolean" and isinstance(value, bool)
    if wrong_bool or not isinstance(value, LITERAL_TYPES[kind]):
        return [f"{path}: {type(value).__name__} where {shape.name} is a {kind}"]
    return _inner_problems(shape, value, path)


def _inner_problems(shape: Any, value: Any, path: str) -> list[str]:
    found: list[str] = []
    kind = shape.type_name
    if kind == "structure":
        members = _members(shape)
        for key, item in value.items():
            name = key[:-2] if key.endswith(".$") else key
            if name not in members:
                found.append(str(_unknown(name, path, shape)))
            elif not key.endswith(".$"):
                found += problems(shape.members[members[name]], item, f"{path}.{name}")
    elif kind == "list":
        for n, item in enumerate(value):
            found += problems(shape.member, item, f"{path}[{n}]")
    elif kind == "map":
        for key, item in value.items():
            if not key.endswith(".$"):
                found += problems(shape.value, item, f"{path}.{key}")
    return found


def to_boto(shape: Any, value: Any, path: str = "Parameters") -> Any:
    """A task's resolved Parameters with botocore's member names, for boto3; raises
    SdkParameterError at the first field Step Functions would refuse."""
    if shape is None:
        return value
    kind = shape.type_name
    if kind == "structure" and isinstance(value, dict):
        members = _members(shape)
        converted = {}
        for key, item in value.items():
            if key not in members:
                raise _unknown(key, path, shape)
            converted[members[key]] = to_boto(shape.members[members[key]], item, f"{path}.{key}")
        return converted
    if kind == "list" and isinstance(value, list):
        return [to_boto(shape.member, item, f"{path}[{n}]") for n, item in enumerate(value)]
    if kind == "map" and isinstance(value, dict):
        return {key: to_boto(shape.value, item, f"{path}.{key}") for key, item in value.items()}
    return value
