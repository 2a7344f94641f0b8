"""Lists the pinned requirements that an environment does not already satisfy.

bootstrap.sh runs it with the Neuron venv's interpreter so that only packages whose
installed version differs from workload/requirements.txt are installed: a second run
installs nothing, and the packages the Neuron SDK ships (torch, torch-xla, torch-neuronx,
neuronx-cc, ...) are never replaced by PyPI builds. Uses only the standard library,
because it runs before anything is installed.

    python requirements_diff.py REQUIREMENTS [--keep NAME,...] [--constraints FILE]

Prints one `name==version` per line to install; warns on stderr about kept packages whose
version differs; writes the kept packages' installed versions to --constraints so that
installing the others cannot replace them.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:==\s*([^\s;#]+))?")
DEFAULT_KEEP = (
    "torch,torch-xla,torch-neuronx,neuronx-cc,libneuronxla,torchvision,neuronx-distributed"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_version(version: str) -> str:
    """Drops the local label: the Neuron venv's "2.9.0+cpu" satisfies a "2.9.0" pin."""
    return version.split("+", 1)[0]


def installed_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[canonical(name)] = dist.version
    return versions


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
    pins: list[tuple[str, str | None]], installed: dict[str, str], keep: set[str]
) -> tuple[list[str], list[str], list[str]]:
    """Returns (to install, warnings, constraints)."""
    install, warnings, constraints = [], [], []
    for name, version in pins:
        key = canonical(name)
        have = installed.get(key)
        satisfied = have is not None and (version is None or base_version(have) == version)
        if key in keep:
            if have is None:
                warnings.append(f"{name} is not installed; the Neuron venv should provide it")
            else:
                constraints.append(f"{name}=={have}")
                if not satisfied:
                    warnings.append(
                        f"{name} {have} is installed, {version} is pinned: keeping {have}"
                    )
            continue
        if not satisfied:
            install.append(f"{name}=={version}" if version else name)
    return install, warnings, constraints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="List pinned requirements not yet installed.")
    parser.add_argument("requirements", type=Path)
    parser.add_argument(
        "--keep", default=DEFAULT_KEEP, help="comma-separated names never installed"
    )
    parser.add_argument("--constraints", type=Path, help="write the kept packages' versions here")
    args = parser.parse_args(argv)
    if not args.requirements.is_file():
        print(f"requirements file {args.requirements} not found", file=sys.stderr)
        return 1
    keep = {canonical(name) for name in args.keep.split(",") if name}
    pins = parse_requirements(args.requirements.read_text())
    install, warnings, constraints = plan(pins, installed_versions(), keep)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.constraints:
        args.constraints.write_text("".join(f"{line}\n" for line in constraints))
    for line in install:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
