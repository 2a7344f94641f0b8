"""A job's code snapshot (scripts/cluster_lib/code.py): the same files give the same bytes,
what is left out, .gitignore through git itself, the size limit, the entry point's checks,
and the data path's; uploads once (HeadObject, then PutObject: botocore's S3 model through a
Stubber, which checks every request and answer against it)."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from scripts.cluster import main as cluster_main
from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.arguments import MODULE, SCRIPT, UsageError, check_data, check_entry
from scripts.cluster_lib.code import Snapshot, reference_snapshot, snapshot, upload
from scripts.cluster_lib.documents import load
from scripts.cluster_lib.job_inputs import data_path, pack


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def members(packed: Snapshot) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        return tar.getmembers()


FILES = {"train.py": "print('train')\n", "lib/model.py": "X = 1\n", "README": "code\n"}


def test_the_same_files_give_the_same_sha_whatever_their_times_modes_and_order(
    tmp_path: Path,
) -> None:
    first = tree(tmp_path / "a", FILES)
    # The same files written in the other order, later, with other permissions and times.
    second = tmp_path / "b"
    for name in reversed(list(FILES)):
        tree(second, {name: FILES[name]})
    for path in second.rglob("*"):
        if path.is_file():
            path.chmod(0o600)
            os.utime(path, (1_000_000, 1_000_000))
    one, two = snapshot(first), snapshot(second)
    assert one.sha256 == two.sha256 and one.data == two.data
    assert one.names == ("README", "lib/model.py", "train.py")
    for info in members(one):
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname) == (0, 0, 0, "", "")
        assert info.mode == 0o644
    # gzip's header holds no time and no file name (RFC 1952: MTIME 0 = none).
    assert one.data[4:8] == b"\0\0\0\0"
    assert gzip.decompress(one.data)
    # A change of content, or of the executable bit, is another snapshot.
    (second / "train.py").write_text("print('other')\n")
    assert snapshot(second).sha256 != one.sha256
    (first / "train.py").chmod(0o755)
    assert snapshot(first).sha256 != one.sha256


def test_caches_environments_and_git_are_left_out(tmp_path: Path) -> None:
    root = tree(tmp_path / "code", {
        **FILES,
        ".git/config": "x", "__pycache__/train.cpython-312.pyc": "x", "lib/model.pyc": "x",
        ".venv/pyvenv.cfg": "home = /usr", ".venv/lib/site.py": "x", "env2/pyvenv.cfg": "x",
        "env2/bin/python": "x", ".pytest_cache/v": "x", ".mypy_cache/v": "x",
        ".ruff_cache/v": "x", "node_modules/a.js": "x", "lib/__pycache__/m.pyc": "x",
    })  # fmt: skip
    assert snapshot(root).names == ("README", "lib/model.py", "train.py")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_what_gitignore_ignores_is_left_out_in_a_work_tree(tmp_path: Path) -> None:
    root = tree(tmp_path / "repo", {**FILES, ".gitignore": "data/\n*.ckpt\n", "data/x.csv": "1",
                                    "sub/.gitignore": "local.py\n", "sub/local.py": "",
                                    "sub/kept.py": "", "model.ckpt": "w"})  # fmt: skip
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    names = snapshot(root).names
    assert names == (".gitignore", "README", "lib/model.py", "sub/.gitignore", "sub/kept.py",
                     "train.py")  # fmt: skip
    # A folder inside a work tree: its files, relative to it.
    assert snapshot(root / "sub").names == (".gitignore", "kept.py")
    # Outside a work tree the same folder keeps everything but the fixed exclusions.
    shutil.rmtree(root / ".git")
    assert "data/x.csv" in snapshot(root).names


def test_over_the_size_limit_one_line_names_the_size_and_the_limit(tmp_path: Path) -> None:
    root = tmp_path / "big"
    root.mkdir()
    (root / "weights.bin").write_bytes(os.urandom(300_000))
    with pytest.raises(ClusterError) as error:
        snapshot(root, limit=100_000)
    message = str(error.value)
    assert "\n" not in message
    assert "1 files (293.0 KiB)" in message and "more than 97.7 KiB compressed" in message
    assert "the limit of a code snapshot" in message


def test_the_reference_workload_travels_as_the_workload_package() -> None:
    packed = reference_snapshot()
    assert "workload/train.py" in packed.names and "workload/__init__.py" in packed.names
    assert all(name.startswith("workload/") for name in packed.names)
    assert not any("__pycache__" in name for name in packed.names)
    assert pack(None, None, None)[1] == "-m workload.train"


@pytest.mark.parametrize(
    ("script", "module", "message"),
    [
        ("../train.py", None, "--entry '../train.py' is not allowed: use the path of a .py file"),
        ("/abs/train.py", None, "--entry '/abs/train.py' is not allowed"),
        (".hidden/train.py", None, "--entry '.hidden/train.py' is not allowed"),
        ("train.sh", None, "--entry 'train.sh' is not allowed"),
        ("a b.py", None, "--entry 'a b.py' is not allowed"),
        (None, "pkg..train", "--module 'pkg..train' is not allowed: use a Python module name"),
        (None, "pkg.train;reboot", "--module 'pkg.train;reboot' is not allowed"),
        ("train.py", "pkg.train", "give --entry SCRIPT or --module MODULE, not both"),
    ],
)
def test_entry_points_are_checked_in_one_line(
    script: str | None, module: str | None, message: str
) -> None:
    with pytest.raises(UsageError) as error:
        check_entry(script, module)
    assert message in str(error.value)


def test_an_entry_script_must_be_in_the_snapshot(tmp_path: Path) -> None:
    root = tree(tmp_path / "code", FILES)
    assert pack(root, "lib/model.py", None)[1] == "lib/model.py"
    assert pack(root, None, "lib.model")[1] == "-m lib.model"
    with pytest.raises(ClusterError, match=r"^the code snapshot has no workload/train\.py, the"):
        pack(root, None, None)
    with pytest.raises(ClusterError) as error:
        pack(root, "src/train.py", None)
    assert str(error.value).startswith(
        "--entry src/train.py is not in the code snapshot: its files include lib/model.py, train.py"
    )


def test_the_cli_and_the_document_agree_on_entry_points() -> None:
    """What the CLI lets through, the RunTraining document's pattern (checked with Go's
    regexp by tests/test_ssm_documents.py) accepts, and the other way round."""
    parameter = load("RunTraining").parameters["EntryPoint"]
    for good in ("train.py", "src/my-job/train_2.py", "-m workload.train", "-m a"):
        parameter.check(good, "entry")
    for bad in ("-m a..b", "../x.py", "x.py;reboot", "-m", "x.sh", "-mx"):
        with pytest.raises(ClusterError):
            parameter.check(bad, "entry")
    assert MODULE.fullmatch("workload.train") and SCRIPT.fullmatch("src/train.py")
    data = load("RunTraining").parameters["DataPath"]
    for good in ("", "/fsx", "/fsx/data/imdb", "/fsx/data/a=1/b+c"):
        data.check(good, "--data")
    for bad in ("/fsxdata", "/fsx/../etc", "/tmp/x", "/fsx/data/a b"):
        with pytest.raises(ClusterError):
            data.check(bad, "--data")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/tmp/data", "--data '/tmp/data' is not allowed: use s3://<the cluster's data bucket>"),
        ("/fsx/../etc", "--data '/fsx/../etc' is not allowed"),
        ("s3://", "--data 's3://' is not an S3 URI"),
    ],
)
def test_data_is_checked_before_any_aws_call(value: str, message: str) -> None:
    with pytest.raises(UsageError) as error:
        check_data(value)
    assert message in str(error.value)


def test_train_refuses_a_bad_entry_before_any_aws_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_main(["train", "--entry", "../x.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--entry '../x.py' is not allowed" in err


def s3_stub() -> tuple[object, Stubber]:
    client = boto3.Session(
        aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    ).client("s3")
    stub = Stubber(client)
    stub.activate()
    return client, stub


def test_a_snapshot_is_uploaded_once(tmp_path: Path) -> None:
    packed = snapshot(tree(tmp_path / "code", FILES))
    client, stub = s3_stub()
    key = f"code/{packed.sha256}.tar.gz"
    stub.add_client_error("head_object", "404", "Not Found", 404,
                          expected_params={"Bucket": "data", "Key": key})  # fmt: skip
    stub.add_response("put_object", {"ETag": '"e"'}, {
        "Bucket": "data", "Key": key, "Body": packed.data, "ContentType": "application/gzip",
        "ChecksumAlgorithm": "SHA256",
    })  # fmt: skip
    assert upload(client, "data", packed) is True
    stub.add_response("head_object", {"ContentLength": packed.size}, {"Bucket": "data", "Key": key})
    assert upload(client, "data", packed) is False
    stub.assert_no_pending_responses()


def test_data_must_be_in_the_cluster_data_bucket_and_not_empty() -> None:
    client, stub = s3_stub()
    with pytest.raises(ClusterError) as error:
        data_path(client, "data", "s3://other/imdb")
    assert "bucket other is not this cluster's data bucket data" in str(error.value)
    stub.add_response("list_objects_v2", {"KeyCount": 0},
                      {"Bucket": "data", "Prefix": "imdb/", "MaxKeys": 1})  # fmt: skip
    with pytest.raises(ClusterError) as error:
        data_path(client, "data", "s3://data/imdb/")
    assert "nothing in s3://data/imdb/: upload the data first" in str(error.value)
    found = {"KeyCount": 1, "Contents": [{"Key": "imdb/train.parquet"}]}
    stub.add_response("list_objects_v2", found,
                      {"Bucket": "data", "Prefix": "imdb/", "MaxKeys": 1})  # fmt: skip
    assert data_path(client, "data", "s3://data/imdb") == "/fsx/data/imdb"
    stub.add_response("list_objects_v2", found,
                      {"Bucket": "data", "Prefix": "imdb/", "MaxKeys": 1})  # fmt: skip
    assert data_path(client, "data", "/fsx/data/imdb/") == "/fsx/data/imdb"
    assert data_path(client, "data", "/fsx/shared/set") == "/fsx/shared/set"
    assert data_path(client, "data", None) == ""
    stub.assert_no_pending_responses()
