"""A job's own Python dependencies on a node (scripts/node/job_python.sh): a venv layered on
the image's Python, built once per node per snapshot from the snapshot's requirements.txt and
wheels/, with real pip and a real venv, offline. The "image's Python" here is the project's
own venv (a venv, as the nodes' workload venv is): `venv --system-site-packages` alone would
not see its packages (the Python library reference, "venv": a venv's system site-packages are
its base interpreter's)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.node_support import REPO_ROOT

#: Sources lib.sh and job_python.sh as launch.sh does, prepares the snapshot's environment,
#: then runs its entry point with the `python` now first on PATH.
HARNESS = """set -Eeuo pipefail
source scripts/node/lib.sh
source scripts/node/job_python.sh
prepare_job_python "$1"
echo "TRAINIUM_PYTHON_ENV=${TRAINIUM_PYTHON_ENV:-}"
cd "$1" && python entry.py
"""

#: A PEP 517 backend inside the project (backend-path), so that `pip wheel --no-deps
#: --no-build-isolation --no-index` builds the wheel offline with nothing installed.
BACKEND = """
import base64, hashlib, zipfile

NAME, VERSION = "tinydep", "1.0"


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    info = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}.py": open(f"{NAME}.py", "rb").read(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n"
        .encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: tiny\\nRoot-Is-Purelib: true\\n"
        b"Tag: py3-none-any\\n",
    }
    record = [_record_line(p, d) for p, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(f"{wheel_directory}/{name}", "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return name
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tinydep-1.0-py3-none-any.whl, built by `pip wheel --no-deps` from a one-module project."""
    project = tmp_path_factory.mktemp("tinydep")
    (project / "tinydep.py").write_text("VALUE = 42\n")
    (project / "backend.py").write_text(BACKEND)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "-w", str(out), str(project)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (built,) = out.glob("tinydep-1.0-*.whl")
    return built


def snapshot(root: Path, wheel: Path, requirements: str = "tinydep==1.0\n") -> Path:
    """A code snapshot as the nodes unpack it: a folder named by its sha256."""
    sha = hashlib.sha256(f"{root}{requirements}".encode()).hexdigest()
    code = root / "code" / sha
    (code / "wheels").mkdir(parents=True)
    (code / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    (code / "requirements.txt").write_text(requirements)
    # The entry point imports the snapshot's package and one the image's Python has.
    (code / "entry.py").write_text(
        textwrap.dedent("""\
            import sys
            import pytest
            import tinydep
            print("tinydep", tinydep.VALUE, "from", tinydep.__file__)
            print("python", sys.prefix)
            print("pytest from", pytest.__file__)
        """)
    )
    return code


def environment(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
        TRAINIUM_ENV_CACHE=str(root / "envs"),
        TRAINIUM_STATE_DIR=str(root / "state"),
        TRAINIUM_LOG_DIR=str(root / "log"),
        TRAINIUM_CLUSTER_ENV=str(root / "cluster.env"),
        PIP_NO_INDEX="1",  # offline: only the snapshot's wheels
    )
    return env


def prepare(root: Path, code: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", "-c", HARNESS, "launch", str(code)], cwd=REPO_ROOT, env=environment(root),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


def test_the_entry_point_imports_the_snapshots_wheel_and_the_images_packages(
    tmp_path: Path, wheel: Path
) -> None:
    code = snapshot(tmp_path, wheel)
    status, out, err = finish(prepare(tmp_path, code))
    assert status == 0, err
    env = tmp_path / "envs" / code.name
    assert f"TRAINIUM_PYTHON_ENV={env}" in out.splitlines()
    # The name is a link to the directory the venv was built in (pip's #! lines hold it).
    assert env.is_symlink() and env.resolve().parent == tmp_path / "envs"
    lines = out.splitlines()
    assert lines[1].startswith(f"tinydep 42 from {env}/lib/"), out
    assert lines[2] == f"python {env}", out
    # pytest is the image's (this test's venv), seen through the job's environment.
    image = Path(sys.prefix).resolve()
    assert Path(lines[3].removeprefix("pytest from ")).resolve().is_relative_to(image), out
    assert err.count("installing the job's") == 1, err
    assert not list((tmp_path / "envs").glob("*.failed.log"))


def test_a_second_launch_reuses_the_environment_without_installing(
    tmp_path: Path, wheel: Path
) -> None:
    code = snapshot(tmp_path, wheel)
    assert finish(prepare(tmp_path, code))[0] == 0
    built = (tmp_path / "envs" / code.name).resolve()
    # Without its wheels an install would fail (no index): the second launch installs nothing.
    for found in (code / "wheels").iterdir():
        found.unlink()
    status, out, err = finish(prepare(tmp_path, code))
    assert status == 0, err
    assert "installing" not in err
    assert "is there already (snapshot" in err
    assert (tmp_path / "envs" / code.name).resolve() == built
    assert out.splitlines()[1].startswith("tinydep 42 from"), out


def test_two_launches_at_once_build_the_environment_once(tmp_path: Path, wheel: Path) -> None:
    code = snapshot(tmp_path, wheel)
    first, second = prepare(tmp_path, code), prepare(tmp_path, code)
    results = [finish(first), finish(second)]
    assert [status for status, _, _ in results] == [0, 0], [err for _, _, err in results]
    errs = "".join(err for _, _, err in results)
    assert errs.count("installing the job's") == 1, errs
    assert errs.count("was built meanwhile by another launch") + errs.count("there already") == 1
    # One venv directory, one link to it, the lock: nothing half built is left.
    envs = tmp_path / "envs"
    built = (envs / code.name).resolve()
    assert {p.name for p in envs.iterdir()} == {code.name, f"{code.name}.lock", built.name}
    assert built.parent == envs and built.is_dir()


def test_a_requirement_the_wheels_lack_fails_in_one_line_and_leaves_no_environment(
    tmp_path: Path, wheel: Path
) -> None:
    code = snapshot(tmp_path, wheel, "tinydep==1.0\nnot-in-the-wheels==3\n")
    status, _, err = finish(prepare(tmp_path, code))
    assert status == 1
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert "pip could not install the job's requirements.txt (status 1): ERROR: " in line
    assert "not-in-the-wheels" in line and f"(from {code}/wheels only)" in line
    assert "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "envs").iterdir()) == [
        f"{code.name}.failed.log", f"{code.name}.lock"
    ]  # fmt: skip


def test_without_requirements_the_images_python_runs_the_job(tmp_path: Path, wheel: Path) -> None:
    code = snapshot(tmp_path, wheel)
    (code / "requirements.txt").unlink()
    (code / "entry.py").write_text("import sys\nprint(sys.prefix)\n")
    status, out, err = finish(prepare(tmp_path, code))
    assert status == 0, err
    assert out.splitlines() == ["TRAINIUM_PYTHON_ENV=", sys.prefix]
    assert not (tmp_path / "envs").exists()


#: A trainer that reports which interpreter torchrun started it with and where its package is.
WORKER = """import os, sys
import tinydep
with open(os.environ["REPORT"], "w") as f:
    f.write(f"{sys.prefix}\\n{tinydep.__file__}\\n")
"""


def test_launch_runs_the_workers_in_the_jobs_environment(tmp_path: Path, wheel: Path) -> None:
    """launch.sh prepares the snapshot's environment once the snapshot is unpacked, and
    torchrun (the environment's own) starts the workers under its interpreter."""
    from tests.node_support import FakeNode, free_port, real_torchrun, unique_job_id

    (tmp_path / "node").mkdir()
    node = FakeNode(tmp_path / "node")
    env = real_torchrun(node)
    (node.code / "wheels").mkdir(parents=True, exist_ok=True)
    (node.code / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    (node.code / "requirements.txt").write_text("tinydep==1.0\n")
    (node.code / "entry.py").write_text(WORKER)
    sha = node.snapshot()
    report = tmp_path / "report"
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/node/launch.sh"), "--hosts", node.loopback,
         "--job-id", unique_job_id("j"), "--nproc-per-node", "1", "--master-port", str(free_port()),
         "--code", sha, "--entry", "entry.py"],
        env=node.env(**env, TRAINIUM_ENV_CACHE=str(tmp_path / "envs"),
                     PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, REPORT=str(report)),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    prefix, module = report.read_text().splitlines()
    job_env = tmp_path / "envs" / sha
    assert Path(prefix).resolve() == job_env.resolve()
    assert Path(module).resolve().is_relative_to(job_env.resolve())
