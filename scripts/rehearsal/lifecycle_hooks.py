"""The Auto Scaling group's termination lifecycle hook, as the stand-in keeps it.

A node that leaves the group (a scale-in) leaves InService at once and waits in Terminating:Wait,
its instance still running, until the hook's action is completed (CompleteLifecycleAction,
termination_watch.sh) or its heartbeat times out; then the group terminates it, with either
result (Amazon EC2 Auto Scaling user guide, "How lifecycle hooks work":
https://docs.aws.amazon.com/autoscaling/ec2/userguide/lifecycle-hooks-overview.html). The hook is
read from the synthesized compute template (stacks/compute.py), so a node is kept exactly as long
as Auto Scaling would keep it, never longer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"


@dataclass(frozen=True)
class TerminationHook:
    """The group's termination lifecycle hook (autoscaling:EC2_INSTANCE_TERMINATING)."""

    name: str
    heartbeat_seconds: int
    default_result: str


def termination_hook(compute_template: dict[str, Any]) -> TerminationHook:
    """The termination hook of the group in the synthesized compute template."""
    (group,) = [
        r["Properties"]
        for r in compute_template["Resources"].values()
        if r["Type"] == "AWS::AutoScaling::AutoScalingGroup"
    ]
    (hook,) = [
        h
        for h in group.get("LifecycleHookSpecificationList", [])
        if h["LifecycleTransition"] == TERMINATING
    ]
    # The defaults: HeartbeatTimeout 3600 s, DefaultResult ABANDON (CloudFormation,
    # AWS::AutoScaling::AutoScalingGroup LifecycleHookSpecification).
    return TerminationHook(
        hook["LifecycleHookName"],
        int(hook.get("HeartbeatTimeout", 3600)),
        hook.get("DefaultResult", "ABANDON"),
    )


@dataclass
class TerminatingNodes:
    """The nodes in Terminating:Wait, each with the timer of its hook's heartbeat time-out.
    `terminate` ends a node (the caller's, under its own lock: `lock`)."""

    hook: TerminationHook
    terminate: Callable[[str], None]
    lock: threading.Lock
    _timers: dict[str, threading.Timer] = field(default_factory=dict)

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._timers

    def wait(self, instance_id: str) -> None:
        """The node enters Terminating:Wait (the caller holds `lock`)."""
        timer = threading.Timer(self.hook.heartbeat_seconds, self._timed_out, [instance_id])
        timer.daemon = True
        self._timers[instance_id] = timer
        timer.start()

    def complete(self, instance_id: str) -> bool:
        """CompleteLifecycleAction (the caller holds `lock`): False if the node is not waiting."""
        timer = self._timers.pop(instance_id, None)
        if timer is None:
            return False
        timer.cancel()
        self.terminate(instance_id)
        return True

    def _timed_out(self, instance_id: str) -> None:
        """The heartbeat timed out: DefaultResult applies, and either result of a termination
        hook terminates the node."""
        with self.lock:
            if self._timers.pop(instance_id, None) is not None:
                self.terminate(instance_id)

    def close(self) -> None:
        for timer in list(self._timers.values()):
            timer.cancel()
