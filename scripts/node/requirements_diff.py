"""Decides which workload requirements go into the workload venv layered on the Neuron venv.

The DLAMI's Neuron PyTorch 2.9 venv (/opt/aws_neuronx_venv_pytorch_2_9) is pinned for
neuronx-cc and torch-neuronx: its torch, torch-xla, torch-neuronx, libneuronxla and
neuronx-cc, and the packages they import (numpy, protobuf, pyyaml, ...), must stay at the
versions the DLAMI ships. The Neuron release notes give ranges, not the venv's exact
versions (Neuron 2.31.1: torch-neuronx 2.9.0.2.15.32035, neuronx-cc 2.26.6360.0,
libneuronxla 2.2.17544.0; "Neuron supports NumPy 2.X and >= 1.21.6"; torch-neuronx wants
transformers >= 4.52; neuronx-cc protobuf > 3: aws-neuron-sdk release-notes/prev/content.rst
and src/helperscripts/n2-manifest.json), so the decision is made on the node from the venv's
own package metadata:

- the Neuron SDK's packages (--keep) are never installed; a differing pin is a warning;
- the packages the training process shares with the Neuron stack, i.e. everything the
  --shared-roots (torch, torch-xla, torch-neuronx, libneuronxla, neuronx-cc) depend on,
  transitively, per the installed metadata, stay at the Neuron venv's versions: a differing
  pin is a warning, and they are written to --constraints so that installing anything else
  cannot replace them;
- every other pin whose installed version differs (transformers, tokenizers, pyarrow, ...)
  is printed, to be installed into the workload venv, which bootstrap.sh layers over the
  Neuron venv (a .pth file adds the Neuron site-packages after its own), so the workload's
  versions take precedence in the workload's processes while the Neuron venv itself, and the
  neuronx-cc processes started from it, stay unchanged.

Run it with the workload venv's interpreter, which sees both environments. Uses only the
standard library, because it runs before anything is installed.

    python requirements_diff.py REQUIREMENTS [--keep NAME,...] [--shared-roots NAME,...]
                                             [--constraints FILE]

Prints one `name==version` per line to install; warnings go to stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:==\s*([^\s;#]+))?")
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
EXTRA_MARKER = re.compile(r";.*\bextra\s*==")
DEFAULT_KEEP = (
    "torch,torch-xla,torch-neuronx,neuronx-cc,libneuronxla,torchvision,neuronx-distributed"
)
DEFAULT_SHARED_ROOTS = "torch,torch-xla,torch-neuronx,libneuronxla,neuronx-cc"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_version(version: str) -> str:
    """Drops the local label: the Neuron venv's "2.9.0+cpu" satisfies a "2.9.0" pin."""
    return version.split("+", 1)[0]


def installed_packages() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(name -> version, name -> required names) of the distributions on sys.path. The first
    one found wins, as for imports: the workload venv's own packages shadow the Neuron venv's."""
    versions: dict[str, str] = {}
    requires: dict[str, list[str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or canonical(name) in versions:
            continue
        key = canonical(name)
        versions[key] = dist.version
        requires[key] = runtime_requirements(dist.requires or [])
    return versions, requires


def runtime_requirements(lines: list[str]) -> list[str]:
    """Names a distribution requires, leaving out those only its extras need. Other markers
    (python_version, sys_platform) are kept: keeping one package too many at the Neuron
    venv's version is safe, replacing one it needs is not."""
    names = []
    for line in lines:
        if EXTRA_MARKER.search(line):
            continue
        match = NAME.match(line)
        if match:
            names.append(canonical(match.group(1)))
    return names


def shared_closure(roots: set[str], requires: dict[str, list[str]]) -> dict[str, str]:
    """Every installed package the roots depend on, transitively: name -> the root it serves."""
    owner: dict[str, str] = {}
    for root in sorted(roots):
        if root not in requires:
            continue
        stack = list(requires[root])
        while stack:
            name = stack.pop()
            if name in owner or name in roots or name not in requires:
                continue
            owner[name] = root
            stack.extend(requires[name])
    return owner


def parse_requirements(text: str) -> list[tuple[str, str | None]]:
    pins = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = PIN.match(line)
        if match:
            pins.append((match.group(1), match.group(2)))
    return pins


def plan(
    pins: list[tuple[str, str | None]],
    installed: dict[str, str],
    keep: set[str],
    shared: dict[str, str] | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """Returns (to install, warnings, constraints). `shared` maps the packages the Neuron
    stack depends on to the Neuron package that needs them."""
    shared = shared or {}
    install, warnings = [], []
    for name, version in pins:
        key = canonical(name)
        have = installed.get(key)
        satisfied = have is not None and (version is None or base_version(have) == version)
        if key in keep:
            if have is None:
                warnings.append(f"{name} is not installed; the Neuron venv should provide it")
            elif not satisfied:
                warnings.append(f"{name} {have} is installed, {version} is pinned: keeping {have}")
            continue
        if key in shared and have is not None:
            if not satisfied:
                warnings.append(
                    f"{name} {have} is installed, {version} is pinned: keeping {have} "
                    f"({shared[key]} in the Neuron venv depends on it)"
                )
            continue
        if not satisfied:
            install.append(f"{name}=={version}" if version else name)
    pinned = sorted((keep | set(shared)) & set(installed))
    constraints = [f"{name}=={installed[name]}" for name in pinned]
    return install, warnings, constraints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="List the pinned requirements to install into the workload venv."
    )
    parser.add_argument("requirements", type=Path)
    parser.add_argument(
        "--keep", default=DEFAULT_KEEP, help="comma-separated Neuron SDK packages, never installed"
    )
    parser.add_argument(
        "--shared-roots",
        default=DEFAULT_SHARED_ROOTS,
        help="comma-separated packages whose dependencies keep the Neuron venv's versions",
    )
    parser.add_argument("--constraints", type=Path, help="write the versions to keep here")
    args = parser.parse_args(argv)
    if not args.requirements.is_file():
        print(f"requirements file {args.requirements} not found", file=sys.stderr)
        return 1
    keep = {canonical(name) for name in args.keep.split(",") if name}
    roots = {canonical(name) for name in args.shared_roots.split(",") if name}
    installed, requires = installed_packages()
    shared = shared_closure(roots, requires)
    pins = parse_requirements(args.requirements.read_text())
    install, warnings, constraints = plan(pins, installed, keep, shared)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.constraints:
        args.constraints.write_text("".join(f"{line}\n" for line in constraints))
    for line in install:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
