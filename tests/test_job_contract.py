"""docs/job-contract.md holds: its example entry point runs as the page says (taken from the page
and run: alone, under torchrun, after a SIGTERM, with a bad flag), its progress lines follow the
schema `jobs` reads, and the herd arithmetic of Python dependencies counts the requests pip
really makes (against a local package index, PEP 503's simple API)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from scripts.cluster_lib.progress import read
from tests.conftest import REPO_ROOT
from tests.workload_support import PYTHON, TORCHRUN, job_env

PAGE = REPO_ROOT / "docs" / "job-contract.md"


def example(directory: Path) -> Path:
    """The page's example entry point: the first Python block under its heading, as train.py."""
    text = PAGE.read_text()
    section = text.split("## An example entry point", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no ```python block under 'An example entry point'"
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "train.py"
    script.write_text(code.group(1))
    return script


def contract_env(root: Path) -> dict[str, str]:
    """The job's environment as launch.sh gives it (the page's table), on this machine."""
    output = root / "jobs" / "demo"
    return {
        **job_env(),
        "TRAINIUM_JOB_ID": "demo",
        "TRAINIUM_OUTPUT_DIR": str(output),
        "TRAINIUM_CHECKPOINT_DIR": str(output / "checkpoints"),
        "TRAINIUM_METRICS_FILE": str(root / "metrics" / "demo.jsonl"),
        "TRAINIUM_LEG_DEADLINE": "0",
    }


def progress(root: Path) -> list[int]:
    records, errors = read((root / "metrics" / "demo.jsonl").read_text().splitlines())
    assert errors == []
    assert {r.phase for r in records} == {"training"}
    return [r.step for r in records]


def saved_step(root: Path) -> int:
    import torch

    state = torch.load(root / "jobs" / "demo" / "checkpoints" / "latest.pt")
    return int(state["step"])


def run(script: Path, root: Path, *args: str, torchrun: bool = False) -> str:
    command = [TORCHRUN, "--standalone", "--nproc_per_node", "2"] if torchrun else [PYTHON]
    (root / "metrics").mkdir(exist_ok=True)
    result = subprocess.run(
        [*command, str(script), *args], cwd=script.parent, env=contract_env(root),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_the_example_entry_point_trains_resumes_and_reports_progress(tmp_path: Path) -> None:
    script = example(tmp_path / "my-job")
    run(script, tmp_path, "--steps", "20")
    assert progress(tmp_path) == [10, 20]
    assert saved_step(tmp_path) == 20
    # The next leg (same folders) goes on from the save, under torchrun on two processes, and
    # only rank 0 writes progress.
    run(script, tmp_path, "--steps", "40", torchrun=True)
    assert progress(tmp_path) == [10, 20, 30, 40]
    assert saved_step(tmp_path) == 40


def test_the_example_saves_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    script = example(tmp_path / "my-job")
    (tmp_path / "metrics").mkdir()
    metrics = tmp_path / "metrics" / "demo.jsonl"
    process = subprocess.Popen(
        [PYTHON, str(script), "--steps", "10000000"], cwd=script.parent,
        env=contract_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120  # an upper bound: the wait is for the first progress line
    while not (metrics.exists() and metrics.read_text().endswith("\n")):
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "no progress line in 120 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    stopped = saved_step(tmp_path)
    assert 10 <= stopped < 10000000
    assert max(progress(tmp_path)) <= stopped


def test_the_example_exits_2_on_a_bad_flag(tmp_path: Path) -> None:
    script = example(tmp_path / "my-job")
    result = subprocess.run(
        [PYTHON, str(script), "--stpes", "5"], cwd=script.parent, env=contract_env(tmp_path),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unrecognized arguments: --stpes 5" in result.stderr


# ---------------------------------------------------------------------------------- herd
def write_wheel(index: Path, name: str, requires: tuple[str, ...] = ()) -> None:
    """A one-module wheel and its project page in a PEP 503 simple index."""
    info = f"{name}-1.0.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}.py": b"VALUE = 1\n",
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [
        f"{path},sha256="
        f"{base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}"
        for path, data in files.items()
    ] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    filename = f"{name}-1.0-py3-none-any.whl"
    project = index / "simple" / name
    project.mkdir(parents=True)
    with zipfile.ZipFile(project / filename, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    (project / "index.html").write_text(f'<a href="{filename}">{filename}</a>\n')


def pip_requests(tmp_path: Path, distributions: int) -> list[str]:
    """The requests one node's `pip install` of a project with distributions - 1 dependencies
    makes to a package index, as the index sees them."""
    index = tmp_path / "index"
    names = [f"dep{i}" for i in range(1, distributions)]
    for name in names:
        write_wheel(index, name)
    write_wheel(index, "app", tuple(names))
    seen: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(index), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            seen.append(self.path)
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # only this index, no configured one
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-cache-dir",
             "--disable-pip-version-check", "--target", str(tmp_path / "site"), "--index-url",
             f"http://127.0.0.1:{server.server_address[1]}/simple/", "app"],
            env=env, check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        server.shutdown()
    return seen


@pytest.mark.parametrize("distributions", [1, 3])
def test_pip_makes_two_index_requests_per_distribution(tmp_path: Path, distributions: int) -> None:
    seen = pip_requests(tmp_path, distributions)
    assert len(seen) == 2 * distributions, seen
    assert sum(path.endswith("/") for path in seen) == distributions  # the project pages
    assert sum(path.endswith(".whl") for path in seen) == distributions  # the files
    assert "pip makes **2 requests per\ndistribution**" in PAGE.read_text()


def test_the_pages_herd_table_and_threshold_follow_from_the_measured_requests() -> None:
    """Each row: nodes, then N x 2 x D for D = 5, 10, 30; the threshold of 1,000 requests in
    a few minutes is PyPI's API policy (pypi/warehouse docs/api-reference/index.rst)."""
    text = PAGE.read_text()
    header = re.search(r"^\| Nodes \|(.*)\|$", text, re.M)
    assert header
    columns = [int(d) for d in re.findall(r"\*D\* = (\d+)", header.group(1))]
    assert columns == [5, 10, 30]
    rows = re.findall(r"^\| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", text, re.M)
    assert [r[0] for r in rows] == ["16", "64", "256", "1,024"]
    for row in rows:
        nodes, *counts = (int(cell.replace(",", "")) for cell in row)
        assert counts == [nodes * 2 * d for d in columns]
    threshold = 1000
    assert "reaches 1,000 requests" in text
    # From 50 nodes with 10 distributions and from 100 nodes with 5.
    assert min(n for n in range(1, 2000) if n * 2 * 10 >= threshold) == 50
    assert min(n for n in range(1, 2000) if n * 2 * 5 >= threshold) == 100
    assert "from\n50 nodes with 10 distributions and from 100 nodes with 5" in text
    # The schema section's example line is valid.
    (line,) = [line for line in text.splitlines() if line.startswith('{"step": 1200')]
    records, errors = read([line])
    assert errors == [] and records[0].step == 1200
