"""The operator's install: `pip install .` puts the `trainium-cluster` command on the PATH with
the CLI's and the CDK app's own dependencies only (pyproject.toml), no torch.

The install is tried offline in a clean virtual environment (python -m venv): the project's
wheel is built from a copy of its sources with this environment's setuptools and wheel (no
build isolation, no index), and the venv's site-packages get exactly the installed
distributions that pyproject.toml's dependencies need, followed through their own
requirements (importlib.metadata, markers evaluated by `packaging`), linked from this
environment instead of downloaded. `pip check` then confirms nothing the dependencies
require is missing, and the CLI and the CDK app run there without torch, the workload's
packages or the test tools.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
#: What the operator's install must not bring: the workload and the test tools.
NOT_FOR_OPERATORS = ("torch", "torch_xla", "transformers", "tokenizers", "moto", "pytest")


def pins(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "-r"))
    ]


def test_the_install_pins_what_the_requirements_files_pin() -> None:
    """One set of pins: pyproject.toml's dependencies are requirements.txt's (the CLI and the
    CDK app), its `workload` extra workload/requirements.txt's."""
    project = PYPROJECT["project"]
    assert sorted(project["dependencies"]) == sorted(pins(REPO_ROOT / "requirements.txt"))
    workload = pins(REPO_ROOT / "workload" / "requirements.txt")
    assert sorted(project["optional-dependencies"]["workload"]) == sorted(workload)


def test_the_command_is_the_clis_main() -> None:
    """A console script calls its function with no arguments and exits with what it returns
    (the entry points specification, packaging.python.org): scripts/cluster.py main() reads
    sys.argv and returns the exit status."""
    from scripts import cluster

    assert PYPROJECT["project"]["scripts"] == {"trainium-cluster": "scripts.cluster:main"}
    with pytest.raises(SystemExit) as exited:  # --help exits through argparse
        cluster.main(["--help"])
    assert exited.value.code == 0
    assert cluster.main(["train", "--job-id", "bad id"]) == 2


def closure(requirements: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `requirements` need, their requirements' followed (extras
    and markers evaluated for this interpreter)."""
    found: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name in found:
            continue
        dist = metadata.distribution(requirement.name)
        found[name] = dist
        for inner in dist.requires or []:
            for wanted in requirement.extras or {""}:
                todo.append((Requirement(inner), wanted))
    return list(found.values())


def link_into(venv: Path, dists: list[metadata.Distribution]) -> None:
    """Each distribution's top-level files and folders (its RECORD) linked into the venv's
    site-packages; its console scripts written for the venv's interpreter."""
    site = Path(sysconfig.get_paths()["purelib"])
    target = next((venv / "lib").glob("python3.*")) / "site-packages"
    python = venv / "bin" / "python"
    for dist in dists:
        for file in dist.files or []:
            top = Path(file).parts[0]
            if top == ".." or (target / top).exists() or not (site / top).exists():
                continue
            (target / top).symlink_to(site / top)
        for entry in dist.entry_points.select(group="console_scripts"):
            script = venv / "bin" / entry.name
            script.write_text(
                f"#!{python}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
                f"sys.exit({entry.attr}())\n"
            )
            script.chmod(0o755)


def clean_env(tmp_path: Path, venv: Path) -> dict[str, str]:
    """No credentials and no profile: the operator's laptop before `aws configure`."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "AWS_CONFIG_FILE": str(home / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
        "LANG": "C.UTF-8",
    }


@pytest.mark.slow
def test_the_operator_install_runs_the_cli_and_the_cdk_app_without_torch(tmp_path: Path) -> None:
    try:
        import wheel  # noqa: F401  (setuptools < 70.1 builds wheels with it)
    except ImportError:
        pytest.fail("the wheel package is missing: make setup installs it (requirements-dev.txt)")
    source = tmp_path / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("scripts", "stacks"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "app.py"):
        shutil.copy2(REPO_ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         str(source), "-w", str(wheels)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (built,) = wheels.glob("trainium_cluster-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)],
                   check=True, timeout=300)  # fmt: skip
    # pip itself, to install the wheel: this environment's, run by the venv's interpreter.
    dists = closure(PYPROJECT["project"]["dependencies"])
    link_into(venv, [*dists, metadata.distribution("pip")])
    env = clean_env(tmp_path, venv)
    python = str(venv / "bin" / "python")

    def run(*args: str, cwd: Path = tmp_path, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, capture_output=True, text=True, cwd=cwd, env={**env, **extra}, timeout=600,
            check=False,
        )  # fmt: skip

    install = run(python, "-m", "pip", "install", "--no-index", "--no-deps", str(built))
    assert install.returncode == 0, install.stdout + install.stderr
    check = run(python, "-m", "pip", "check")
    assert check.returncode == 0, check.stdout
    absent = run(python, "-c", "import importlib.util as u, sys; "
                 f"print([m for m in {NOT_FOR_OPERATORS!r} if u.find_spec(m)])")  # fmt: skip
    assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr

    helped = run("trainium-cluster", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "status" in helped.stdout and "Traceback" not in helped.stderr
    status = run("trainium-cluster", "status")
    assert status.returncode == 1, status.stdout + status.stderr
    assert len(status.stderr.strip().splitlines()) == 1, status.stderr
    assert status.stderr.startswith("error: ") and "credentials" in status.stderr, status.stderr
    # The documented path still works beside the command (the repository's checkout).
    assert run(python, str(REPO_ROOT / "scripts" / "cluster.py"), "--help").returncode == 0

    # The CDK app, as `cdk synth` runs it from the checkout (cdk.json's app, its context).
    context = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    out = tmp_path / "cdk.out"
    synth = run(python, "app.py", cwd=REPO_ROOT, CDK_OUTDIR=str(out),
                CDK_CONTEXT_JSON=json.dumps(context))  # fmt: skip
    assert synth.returncode == 0, synth.stderr[-3000:]
    templates = sorted(p.name for p in out.glob("*.template.json"))
    assert len(templates) == 4, templates
