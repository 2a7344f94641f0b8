"""The cluster's FSx for Lustre file system: `cluster.py export` writes its new and changed
files to S3 before the storage stack is destroyed (contract C6).

The operations stack names the file system (`FileSystemId`) and the file-system paths of its
data repository associations (`ExportPaths`); an EXPORT_TO_REPOSITORY data repository task
copies them out, and the CLI follows it to its end.
"""

from __future__ import annotations

from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import Patience, aws_errors
from scripts.cluster_lib.outputs import EXPORT_OUTPUTS, Stack

EXPORT_DONE = {"SUCCEEDED", "FAILED", "CANCELED"}


class Storage:
    """Exports of the file system through its data repository associations."""

    def __init__(self, fsx: Any, stack: Stack, patience: Patience) -> None:
        self.fsx = fsx
        self.stack = stack
        self.patience = patience

    def export(self, *, timeout: float) -> dict[str, Any]:
        """Exports the file system's new and changed files to S3 through its data repository
        associations (an EXPORT_TO_REPOSITORY task) and waits for it (contract C6)."""
        values = self.stack.outputs().values
        missing = [key for key in EXPORT_OUTPUTS if not values.get(key)]
        if missing:
            raise ClusterError(
                f"stack {self.stack.name} lacks the outputs {', '.join(missing)}: redeploy it "
                "from this version of the project"
            )
        file_system = values["FileSystemId"]
        paths = [p.strip() for p in values["ExportPaths"].split(",") if p.strip()]
        task_id = self._start(file_system, paths)
        self.patience.out(
            f"export task {task_id} started: {', '.join(paths) or '/'} of {file_system} to S3"
        )
        return self._follow(task_id, timeout)

    def _start(self, file_system: str, paths: list[str]) -> str:
        """Starts the export task; returns its ID."""
        # CreateDataRepositoryTask wants export paths relative to the mount point ("path1"
        # for /mnt/fsx/path1; botocore's fsx model, CreateDataRepositoryTask Paths); none at
        # all exports the whole file system.
        relative = [p.strip("/") for p in paths]
        kwargs: dict[str, Any] = {}
        if relative and all(relative):
            kwargs["Paths"] = relative
        try:
            with aws_errors(f"starting the export of {file_system}"):
                task = self.fsx.create_data_repository_task(
                    Type="EXPORT_TO_REPOSITORY",
                    FileSystemId=file_system,
                    Report={"Enabled": False},
                    **kwargs,
                )["DataRepositoryTask"]
        except ClusterError as error:
            if "DataRepositoryTaskExecuting" in str(error):
                raise ClusterError(
                    f"another data repository task runs on {file_system}: wait for it to end "
                    "(`aws fsx describe-data-repository-tasks`), then export again"
                ) from None
            raise
        task_id: str = task["TaskId"]
        return task_id

    def _follow(self, task_id: str, timeout: float) -> dict[str, Any]:
        """Says how the task gets on until it ends; returns it when every file was exported."""
        deadline = self.patience.clock() + timeout
        hint = (
            f"export task {task_id} goes on: "
            f"`aws fsx describe-data-repository-tasks --task-ids {task_id}`"
        )
        last = ""
        while True:
            response = self.patience.patiently(
                "following the export",
                lambda: self.fsx.describe_data_repository_tasks(TaskIds=[task_id]),
                hint=hint,
            )
            if response is not None:
                task = response["DataRepositoryTasks"][0]
                lifecycle = task.get("Lifecycle", "")
                status = task.get("Status", {})
                line = (
                    f"export task {task_id}: {lifecycle}, {status.get('SucceededCount', 0)} of "
                    f"{status.get('TotalCount', 0)} files exported, "
                    f"{status.get('FailedCount', 0)} failed"
                )
                if line != last:
                    self.patience.out(line)
                    last = line
                if lifecycle == "SUCCEEDED":
                    if status.get("FailedCount", 0):
                        raise ClusterError(
                            f"export task {task_id} ended with {status['FailedCount']} files not "
                            "exported: check them before destroying the storage stack"
                        )
                    return dict(task)
                if lifecycle in EXPORT_DONE:
                    reason = task.get("FailureDetails", {}).get("Message", "no reason given")
                    raise ClusterError(f"export task {task_id} {lifecycle}: {reason}")
            if self.patience.clock() >= deadline:
                raise ClusterError(
                    f"export task {task_id} still runs after {timeout:.0f} s; {hint}"
                )
            self.patience.pause()
