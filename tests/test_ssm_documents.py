"""The SSM Command documents: the contract the operations stack and the CLI rely on, and
the allowed patterns that keep shell metacharacters away from the node scripts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.cluster_lib.documents import DOCUMENT_NAMES, load

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = REPO_ROOT / "stacks" / "ssm_documents"
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")

EXPECTED = {
    "RunTraining": (
        "launch.sh",
        {
            "Hosts": None,
            "JobId": None,
            "MasterPort": "29500",
            "NprocPerNode": "auto",
            "TrainArgs": "",
        },
    ),
    "Precompile": (
        "precompile.sh",
        {
            "Hosts": None,
            "JobId": None,
            "MasterPort": "29500",
            "NprocPerNode": "auto",
            "Steps": "10",
            "TrainArgs": "",
        },
    ),
    "Preflight": ("preflight.sh", {"Hosts": None, "Port": "29600"}),
    "StopTraining": ("stop.sh", {"JobId": None}),
}

GOOD = {
    "Hosts": ["10.0.1.5", "10.0.1.5,10.0.1.6,10.0.2.250"],
    "JobId": ["bert-1", "run_2026.05.01", "A"],
    "MasterPort": ["29500", "65534"],
    "Port": ["29600"],
    "NprocPerNode": ["auto", "1", "32"],
    "Steps": ["10", "1"],
    "TrainArgs": [
        "",
        "--data /fsx/data/imdb --model tiny --max-steps 1000 --lr 3e-5",
        "--config /fsx/configs/bert-base.yaml --batch-size=16 --task causal-lm",
    ],
}

INJECTIONS = [
    "; rm -rf /",
    "x; rm -rf /",
    "$(reboot)",
    "${IFS}reboot",
    "`reboot`",
    "a'b",
    'a"b',
    "a\nreboot",
    "a | tee /etc/passwd",
    "a && reboot",
    "a > /etc/fstab",
    "a < /etc/shadow",
    "*",
    "~root",
    "a\\nb",
    "a#b",
    "a\tb",
    "(reboot)",
    "{a,b}",
    "!1",
]


def raw(name: str) -> dict[str, Any]:
    content: dict[str, Any] = yaml.safe_load((DOCUMENTS / f"{name}.yaml").read_text())
    return content


def test_every_document_in_the_folder_is_one_of_the_four() -> None:
    assert sorted(p.stem for p in DOCUMENTS.glob("*.yaml")) == sorted(DOCUMENT_NAMES)
    assert sorted(EXPECTED) == sorted(DOCUMENT_NAMES)


@pytest.mark.parametrize("name", DOCUMENT_NAMES)
def test_document_is_a_shell_command_document(name: str) -> None:
    content = raw(name)
    assert content["schemaVersion"] == "2.2"
    assert content["description"]
    assert len(content["mainSteps"]) == 1
    step = content["mainSteps"][0]
    assert step["action"] == "aws:runShellScript"
    assert step["name"] == name
    timeout = int(step["inputs"]["timeoutSeconds"])
    assert 60 <= timeout <= 172800  # SSM's limit for one invocation is 48 hours
    assert len(step["inputs"]["runCommand"]) == 1


def test_training_runs_as_long_as_ssm_allows() -> None:
    assert raw("RunTraining")["mainSteps"][0]["inputs"]["timeoutSeconds"] == "172800"


@pytest.mark.parametrize("name", DOCUMENT_NAMES)
def test_parameters_and_defaults_follow_the_contract(name: str) -> None:
    _, expected = EXPECTED[name]
    parameters = raw(name)["parameters"]
    assert list(parameters) == list(expected)
    for key, default in expected.items():
        spec = parameters[key]
        assert spec["type"] == "String"
        assert spec["description"]
        assert spec["allowedPattern"].startswith("^")
        assert spec["allowedPattern"].endswith("$")
        assert spec.get("default") == default
        if default is not None:
            assert re.search(spec["allowedPattern"], default), f"{name}.{key} default"


@pytest.mark.parametrize("name", DOCUMENT_NAMES)
def test_command_calls_its_node_script_with_every_parameter(name: str) -> None:
    script, expected = EXPECTED[name]
    command = load(name).run_command[0]
    assert command.startswith(f"bash /opt/trainium-cluster/scripts/node/{script} ")
    assert (REPO_ROOT / "scripts" / "node" / script).is_file()
    assert sorted(PLACEHOLDER.findall(command)) == sorted(expected)
    # Every value but the train.py arguments is single-quoted: even a value that slipped
    # past its pattern stays one word. TrainArgs comes last, unquoted, to be split.
    for key in expected:
        if key == "TrainArgs":
            assert command.endswith("-- {{ TrainArgs }}")
        else:
            assert f"'{{{{ {key} }}}}'" in command


@pytest.mark.parametrize("name", DOCUMENT_NAMES)
def test_options_in_the_command_are_ones_the_script_accepts(name: str) -> None:
    script, _ = EXPECTED[name]
    text = (REPO_ROOT / "scripts" / "node" / script).read_text()
    usage = text.split("set -Eeuo pipefail", 1)[0]
    command = load(name).run_command[0]
    for option in re.findall(r"\s(--[a-z-]+)\s", command):
        assert option in usage, f"{script} does not document {option}"
        assert option in text.split("set -Eeuo pipefail", 1)[1], f"{script} does not parse {option}"


@pytest.mark.parametrize("key", sorted(GOOD))
def test_patterns_accept_ordinary_values(key: str) -> None:
    for name in DOCUMENT_NAMES:
        parameter = load(name).parameters.get(key)
        if parameter is None:
            continue
        for value in GOOD[key]:
            assert re.search(parameter.allowed_pattern, value), f"{name}.{key} refuses {value!r}"
            parameter.check(value, key)


@pytest.mark.parametrize("name", DOCUMENT_NAMES)
@pytest.mark.parametrize("injection", INJECTIONS)
def test_patterns_reject_shell_metacharacters(name: str, injection: str) -> None:
    for key, parameter in load(name).parameters.items():
        for value in (injection, f"{GOOD[key][-1]}{injection}", f"{injection}{GOOD[key][-1]}"):
            assert not re.search(parameter.allowed_pattern, value), f"{name}.{key} allows {value!r}"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Hosts", "10.0.0.1,"),
        ("Hosts", "10.0.0.1 10.0.0.2"),
        ("Hosts", "ip-10-0-0-1"),
        ("JobId", "-rf"),
        ("JobId", ".."),
        ("JobId", "x" * 65),
        ("MasterPort", "0"),
        ("MasterPort", "123456"),
        ("NprocPerNode", "0"),
        ("NprocPerNode", "all"),
        ("TrainArgs", "x" * 2049),
    ],
)
def test_patterns_reject_malformed_values(key: str, value: str) -> None:
    parameter = load("RunTraining").parameters[key]
    assert not re.search(parameter.allowed_pattern, value)


def test_rendered_command_splits_train_args_into_words() -> None:
    values = {
        "Hosts": "10.0.0.1,10.0.0.2", "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "auto", "TrainArgs": "--model tiny --lr 3e-5",
    }  # fmt: skip
    command = PLACEHOLDER.sub(lambda m: values[m.group(1)], load("RunTraining").run_command[0])
    assert shlex.split(command) == [
        "bash", "/opt/trainium-cluster/scripts/node/launch.sh", "--hosts", "10.0.0.1,10.0.0.2",
        "--job-id", "bert-1", "--master-port", "29500", "--nproc-per-node", "auto",
        "--", "--model", "tiny", "--lr", "3e-5",
    ]  # fmt: skip
