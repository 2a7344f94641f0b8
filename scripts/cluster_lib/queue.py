"""The cluster's job queue, as the CLI sees it: a DynamoDB table and a dispatcher state machine
(stacks/job_queue.py, outputs `JobQueueTableName` and `JobDispatcherArn`).

`train` puts the job in the queue (the supervisor execution's name and input, chosen now) and
starts the dispatcher, which starts the queue's oldest job when no job holds the slot; the
dispatcher runs again, started by EventBridge, whenever a supervisor execution ends, so the next
job starts without the operator's terminal. `jobs` lists the queue, `stop` takes a job off it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import aws_errors, error_code
from scripts.cluster_lib.outputs import Stack

#: The queue's items and the slot (stacks/job_queue.py).
QUEUE, SLOT = "queue", "slot"
QUEUE_TABLE_OUTPUT, DISPATCHER_OUTPUT = "JobQueueTableName", "JobDispatcherArn"
#: A conditional write whose condition did not hold (DynamoDB API reference, common errors).
CONDITION_FAILED = "ConditionalCheckFailedException"


@dataclass(frozen=True)
class Queued:
    """A queued job: its position (1 is next), ID, sort key, execution name and submission."""

    position: int
    job_id: str
    key: str
    execution_name: str
    submitted_at: str


class JobQueue:
    """The queue's table and its dispatcher."""

    def __init__(self, dynamodb: Any, stepfunctions: Any, stack: Stack) -> None:
        self.dynamodb = dynamodb
        self.sfn = stepfunctions
        self.stack = stack

    def _output(self, name: str) -> str:
        outputs = self.stack.outputs()
        value = outputs.values.get(name)
        if not value:
            raise ClusterError(
                f"stack {outputs.stack_name} has no {name} output (the job queue): redeploy the "
                "operations stack from this version of the project"
            )
        return value

    @property
    def table(self) -> str:
        return self._output(QUEUE_TABLE_OUTPUT)

    def queued(self) -> list[Queued]:
        """The queued jobs, oldest (next to start) first."""
        found: list[Queued] = []
        kwargs: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "Pk = :queue",
            "ExpressionAttributeValues": {":queue": {"S": QUEUE}},
            "ConsistentRead": True,
        }
        with aws_errors("reading the job queue"):
            while True:
                page = self.dynamodb.query(**kwargs)
                for item in page["Items"]:
                    found.append(
                        Queued(
                            position=len(found) + 1,
                            job_id=item["JobId"]["S"],
                            key=item["Sk"]["S"],
                            execution_name=item["ExecutionName"]["S"],
                            submitted_at=item["SubmittedAt"]["S"],
                        )
                    )
                if "LastEvaluatedKey" not in page:
                    return found
                kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def slot(self) -> dict[str, str]:
        """The job that holds the cluster (JobId, ExecutionName), or {} when none does."""
        with aws_errors("reading the job queue"):
            item = self.dynamodb.get_item(
                TableName=self.table,
                Key={"Pk": {"S": SLOT}, "Sk": {"S": SLOT}},
                ConsistentRead=True,
            ).get("Item", {})
        return {k: v["S"] for k, v in item.items() if "S" in v}

    def enqueue(self, job_id: str, execution_name: str, job: dict[str, Any]) -> None:
        """Puts the job at the end of the queue: its supervisor execution's name and input."""
        now = datetime.now(UTC)
        stamp = f"{now:%Y-%m-%dT%H:%M:%S.%fZ}"
        item = {
            "Pk": {"S": QUEUE},
            "Sk": {"S": f"{stamp}#{job_id}"},
            "JobId": {"S": job_id},
            "ExecutionName": {"S": execution_name},
            "Input": {"S": json.dumps(job)},
            "SubmittedAt": {"S": stamp},
        }
        with aws_errors("queueing the job"):
            self.dynamodb.put_item(
                TableName=self.table, Item=item, ConditionExpression="attribute_not_exists(Pk)"
            )

    def dispatch(self) -> None:
        """Starts the dispatcher, which starts the queue's head if no job holds the cluster."""
        with aws_errors("starting the job queue's dispatcher"):
            self.sfn.start_execution(
                stateMachineArn=self._output(DISPATCHER_OUTPUT), name=str(uuid.uuid4()), input="{}"
            )

    def remove(self, job_id: str) -> bool:
        """Takes the job off the queue; False when it is not queued (any more). The delete is
        conditional: a job the dispatcher took meanwhile is not queued, and it starts."""
        for queued in self.queued():
            if queued.job_id != job_id:
                continue
            with aws_errors("taking the job off the queue"):
                try:
                    self.dynamodb.delete_item(
                        TableName=self.table,
                        Key={"Pk": {"S": QUEUE}, "Sk": {"S": queued.key}},
                        ConditionExpression="attribute_exists(Pk)",
                    )
                except ClientError as error:
                    if error_code(error) == CONDITION_FAILED:
                        return False
                    raise
            return True
        return False
