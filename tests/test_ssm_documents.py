"""The SSM Command documents: the contract the operations stack and the CLI rely on, and
the allowed patterns that keep shell metacharacters away from the node scripts.

Patterns are checked with Go's own regexp package (scripts/rehearsal/ssm_agent/
paramcheck.go, the calls the SSM agent makes), not only with Python's `re`: Go refuses
repeat counts above 1000, nested counts multiplied, where Python accepts them."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.documents import DOCUMENT_NAMES, Parameter, load
from scripts.rehearsal.ssm_agent import go_check, substitute

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
            "CodeSnapshot": None,
            "EntryPoint": "-m workload.train",
            "DataPath": "",
            "ExecutionTimeout": "172800",
            "StopGraceSeconds": "1800",
            "Resume": "resume",
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
            "CodeSnapshot": None,
            "EntryPoint": "-m workload.train",
            "DataPath": "",
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
    "ExecutionTimeout": ["172800", "3600", "60"],
    "StopGraceSeconds": ["1800", "30"],
    "Resume": ["new", "resume"],
    "TrainArgs": [
        "",
        "--data /fsx/data/imdb --model tiny --max-steps 1000 --lr 3e-5",
        "--config /fsx/configs/bert-base.yaml --batch-size=16 --task causal-lm",
    ],
    "CodeSnapshot": ["0" * 64, "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"],
    "EntryPoint": ["train.py", "src/my_job/train-2.py", "-m workload.train"],
    "DataPath": ["", "/fsx", "/fsx/data/imdb", "/fsx/data/reviews/part=1"],
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


def timeouts() -> list[tuple[str, str, Any]]:
    """Every step timeout: (document, step, timeoutSeconds)."""
    return [
        (name, step["name"], step["inputs"]["timeoutSeconds"])
        for name in DOCUMENT_NAMES
        for step in raw(name)["mainSteps"]
        if "timeoutSeconds" in step["inputs"]
    ]


def test_execution_timeouts_are_within_what_the_agent_honours() -> None:
    """The agent replaces a timeoutSeconds outside 5..172800 with 3600, silently
    (aws/amazon-ssm-agent agent/plugins/pluginutil/pluginutil.go: minExecutionTimeoutInSeconds
    5, maxExecutionTimeoutInSeconds 172800, defaultExecutionTimeoutInSeconds 3600). A parameter
    that sets it must accept exactly that range, through the agent's own Go regexp."""
    parameters = []
    for name, step, timeout in timeouts():
        match = PLACEHOLDER.fullmatch(str(timeout))
        if match is None:
            assert 5 <= int(timeout) <= 172800, f"{name}.{step} timeoutSeconds {timeout}"
        else:
            parameters.append(load(name).parameters[match.group(1)])
    assert [p.name for p in parameters] == ["ExecutionTimeout"]
    values = ["4", "5", "9", "10", "99999", "100000", "169999", "171999", "172799", "172800",
              "172801", "180000", "999999", "0", "05", "1", "1728000"]  # fmt: skip
    for parameter in parameters:
        errors = go_check([go_case(parameter, value) for value in values])
        accepted = [v for v, error in zip(values, errors, strict=True) if error is None]
        assert accepted == [v for v in values if v == str(int(v)) and 5 <= int(v) <= 172800]
        assert accepted == [
            "5", "9", "10", "99999", "100000", "169999", "171999", "172799", "172800"
        ]  # fmt: skip
        assert [v for v in values if cli_accepts(parameter, v)] == accepted


@pytest.mark.parametrize("name", DOCUMENT_NAMES)
def test_document_is_a_shell_command_document(name: str) -> None:
    content = raw(name)
    assert content["schemaVersion"] == "2.2"
    assert content["description"]
    assert len(content["mainSteps"]) == 1
    step = content["mainSteps"][0]
    assert step["action"] == "aws:runShellScript"
    assert step["name"] == name
    defaults = {key: spec.get("default", "") for key, spec in content["parameters"].items()}
    timeout = int(substitute(step["inputs"]["timeoutSeconds"], defaults))
    assert 60 <= timeout <= 172800  # SSM's limit for one invocation is 48 hours
    assert len(step["inputs"]["runCommand"]) == 1


def test_training_runs_as_long_as_ssm_allows_and_the_launcher_knows_the_limit() -> None:
    step = raw("RunTraining")["mainSteps"][0]
    assert step["inputs"]["timeoutSeconds"] == "{{ ExecutionTimeout }}"
    assert raw("RunTraining")["parameters"]["ExecutionTimeout"]["default"] == "172800"
    # launch.sh gets the same value, so it can end the leg itself before the agent kills it.
    assert "--time-limit '{{ ExecutionTimeout }}'" in step["inputs"]["runCommand"][0]


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


def agent_check(parameter: Parameter, value: str | None) -> str | None:
    """The agent's verdict on one value (None: accepted), from Go."""
    return go_check([go_case(parameter, value)])[0]


def go_case(parameter: Parameter, value: str | None) -> dict[str, Any]:
    return {
        "pattern": parameter.allowed_pattern,
        "minChars": parameter.min_chars,
        "maxChars": parameter.max_chars,
        "value": value,
    }


def cli_accepts(parameter: Parameter, value: str) -> bool:
    try:
        parameter.check(value, parameter.name)
    except ClusterError:
        return False
    return True


def all_parameters() -> list[tuple[str, Parameter]]:
    return [(name, p) for name in DOCUMENT_NAMES for p in load(name).parameters.values()]


def test_every_pattern_compiles_with_the_agents_go_regexp() -> None:
    parameters = all_parameters()
    errors = go_check([go_case(p, None) for _, p in parameters])
    failures = {f"{name}.{p.name}": e for (name, p), e in zip(parameters, errors, strict=True) if e}
    assert failures == {}


def test_go_refuses_the_repeat_counts_python_accepts() -> None:
    """The checker can fail: Python compiles these, the agent's Go regexp does not."""
    for pattern in (
        "^[A-Za-z0-9 ._,=:/+-]{0,2048}$",
        "^[0-9]{1,3}(\\.[0-9]{1,3}){3}(,[0-9]{1,3}(\\.[0-9]{1,3}){3}){0,255}$",
    ):
        re.compile(pattern)
        (error,) = go_check([{"pattern": pattern, "value": None}])
        assert error is not None and "invalid repeat count" in error


def test_every_default_passes_the_agents_checks() -> None:
    cases = [(n, p) for n, p in all_parameters() if p.default is not None]
    errors = go_check([go_case(p, p.default) for _, p in cases])
    assert [e for e in errors if e] == []


@pytest.mark.parametrize("key", sorted(GOOD))
def test_patterns_accept_ordinary_values(key: str) -> None:
    cases = [(n, p, v) for n, p in all_parameters() if p.name == key for v in GOOD[key]]
    assert cases, key
    errors = go_check([go_case(p, v) for _, p, v in cases])
    for (name, parameter, value), error in zip(cases, errors, strict=True):
        assert error is None, f"the agent refuses {name}.{key}={value!r}: {error}"
        assert cli_accepts(parameter, value), f"the CLI refuses {name}.{key}={value!r}"


def test_patterns_reject_shell_metacharacters() -> None:
    cases = [
        (name, parameter, value)
        for name, parameter in all_parameters()
        for injection in INJECTIONS
        for value in (
            injection,
            f"{GOOD[parameter.name][-1]}{injection}",
            f"{injection}{GOOD[parameter.name][-1]}",
        )
    ]
    errors = go_check([go_case(p, v) for _, p, v in cases])
    for (name, parameter, value), error in zip(cases, errors, strict=True):
        assert error is not None, f"the agent allows {name}.{parameter.name}={value!r}"
        label = f"{name}.{parameter.name}={value!r}"
        assert not cli_accepts(parameter, value), f"the CLI allows {label}"


def hosts(count: int) -> str:
    return ",".join(f"10.0.{i // 200}.{100 + i % 200}" for i in range(count))


def test_hosts_take_a_1024_node_cluster_and_refuse_more() -> None:
    """The host list of 1,024 nodes, each address at its longest (15 characters), fits in
    maxChars, for the agent (Go) and the CLI; one more address does not."""
    for name in ("RunTraining", "Preflight", "Precompile"):
        parameter = load(name).parameters["Hosts"]
        widest = ",".join(["100.100.100.100"] * 1024)
        assert len(widest) == parameter.max_chars == 16383
        too_many = ",".join(["100.100.100.100"] * 1025)
        accepted, refused = go_check([go_case(parameter, widest), go_case(parameter, too_many)])
        assert accepted is None, accepted
        assert refused is not None and "maxChars" in refused
        assert cli_accepts(parameter, widest) and cli_accepts(parameter, hosts(1024))
        with pytest.raises(ClusterError, match="at most 16383"):
            parameter.check(too_many, "Hosts")


#: The longest value of each parameter that has no maxChars, as its pattern bounds it; the
#: test below checks with Go that it is accepted and that one character more is not.
LONGEST_BY_PATTERN = {
    "JobId": "A" * 64,
    "MasterPort": "99999",
    "Port": "99999",
    "NprocPerNode": "auto",
    "ExecutionTimeout": "172800",
    "StopGraceSeconds": "999999",
    "Steps": "9999",
    "CodeSnapshot": "f" * 64,
    "Resume": "resume",
}
#: SendCommand: "The content of the document must not exceed 64KB. This quota also includes the
#: content specified for input parameters at runtime" (SSM CreateDocument API reference,
#: Content). Half of it is what the documents may reach with every parameter at its
#: longest.
SEND_COMMAND_LIMIT = 64 * 1024


def test_a_command_with_every_parameter_at_its_longest_stays_far_below_64_kb() -> None:
    """Each document's content (as YAML with its comments, and as the JSON the stack deploys)
    plus every parameter at its longest (maxChars, or the longest value its pattern allows)
    stays under half of SendCommand's 64 KB: the 1,024-node host list (16,383) and
    TrainArgs (2,048) are most of it."""
    for name in DOCUMENT_NAMES:
        document = load(name)
        cases, longest = [], {}
        for parameter in document.parameters.values():
            if parameter.max_chars is not None:
                longest[parameter.name] = parameter.max_chars
                continue
            value = LONGEST_BY_PATTERN.get(parameter.name)
            assert value is not None, f"{name}.{parameter.name}: no maxChars, no known bound"
            cases += [go_case(parameter, value), go_case(parameter, value + "9")]
            longest[parameter.name] = len(value)
        verdicts = go_check(cases) if cases else []
        assert verdicts[0::2] == [None] * (len(cases) // 2), verdicts
        assert all(v is not None for v in verdicts[1::2]), verdicts
        content = max(
            len(document.path.read_bytes()),
            len(json.dumps(document.content, separators=(",", ":")).encode()),
        )
        total = content + sum(longest.values())
        print(f"{name}: {content} bytes of document + {longest} = {total}")
        assert total < SEND_COMMAND_LIMIT / 2, (name, total)


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
        ("ExecutionTimeout", "0"),
        ("ExecutionTimeout", "1728000"),
        ("StopGraceSeconds", "-1"),
        ("CodeSnapshot", "F" * 64),
        ("CodeSnapshot", "0" * 63),
        ("CodeSnapshot", "0" * 65),
        ("EntryPoint", "../train.py"),
        ("EntryPoint", "/opt/train.py"),
        ("EntryPoint", ".hidden/train.py"),
        ("EntryPoint", "-m workload..train"),
        ("EntryPoint", "-mworkload.train"),
        ("EntryPoint", "train.sh"),
        ("DataPath", "/fsx/../etc"),
        ("DataPath", "/data"),
        ("DataPath", "/fsxdata"),
        ("Resume", "fresh"),
        ("Resume", "newer"),
    ],
)
def test_patterns_reject_malformed_values(key: str, value: str) -> None:
    parameter = load("RunTraining").parameters[key]
    assert agent_check(parameter, value) is not None
    assert not cli_accepts(parameter, value)


def test_rendered_command_splits_train_args_into_words() -> None:
    values = {
        "Hosts": "10.0.0.1,10.0.0.2", "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "auto", "TrainArgs": "--model tiny --lr 3e-5",
        "ExecutionTimeout": "172800", "StopGraceSeconds": "1800", "CodeSnapshot": "a" * 64,
        "EntryPoint": "-m workload.train", "DataPath": "/fsx/data/imdb",
        "Resume": "new",
    }  # fmt: skip
    command = substitute(load("RunTraining").run_command[0], values)
    assert shlex.split(command) == [
        "bash", "/opt/trainium-cluster/scripts/node/launch.sh", "--hosts", "10.0.0.1,10.0.0.2",
        "--job-id", "bert-1", "--master-port", "29500", "--nproc-per-node", "auto",
        "--code", "a" * 64, "--entry", "-m workload.train", "--data", "/fsx/data/imdb",
        "--time-limit", "172800", "--stop-grace", "1800", "--resume", "new",
        "--", "--model", "tiny", "--lr", "3e-5",
    ]  # fmt: skip
