"""A simulated fleet for the scale rehearsal: up to 1,024 instances behind the AWS stand-in,
without namespaces, agents or trainers.

The stand-in's SSM, EC2, Auto Scaling and CloudWatch Logs answer for these instances exactly as
for the rehearsal's real nodes (aws_stand_in.py, ssm_stand_in.py): SendCommand checks the
parameters with Go's regexp and writes each invocation's spec; what differs is who answers the
invocation. Instead of an agent per node running the document's script, `SimulatedAgents`
answers every node's invocation as the test tells it, in the agent's terms: status.json beside
the invocation (InProgress while it runs; Success, Failed or Cancelled from
ssm_agent.runscript.plugin_result, as node_agent.py writes it). Preflight, Precompile and
StopTraining end at once with status 0, each with full-size output (SIMULATED_STDOUT, more
than the agent keeps); RunTraining starts (its node counts as launched) and
runs until the test ends it (`finish`, `fail`) or the supervisor cancels it (the agent's
SIGKILL, 137: Cancelled). An instance that dies (`die`) answers nothing more: its invocations
stay InProgress, as on AWS, and the group launches a replacement in its place.

A few sample nodes (`real_slots`, first and last included) run RunTraining for real: the
document's command line as the agent starts it (runscript.start_script: `sh -c`, the agent's
environment, soft RLIMIT_NOFILE 1024, output through the byte-per-write copier), so launch.sh
parses the 1,024-host list, finds the node's rank, raises the open-file limit, checks the node
and starts torchrun: a stand-in (FAKE_TORCHRUN) that reports its start and exits as told. The
paths a node has under /etc, /var and /opt are in its folder here (no mount namespace), and
its address and NeuronCores come from fake `ip` and `neuron-ls`. Preflight stays simulated on
every node: its collective check needs every node's process.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.cluster_lib import REPO_ROOT
from scripts.rehearsal.hosts import kill_pids, tagged_pids
from scripts.rehearsal.instances import INSTALL_ROOT, Instance, Instances, software_version
from scripts.rehearsal.ssm_agent.runscript import AgentScript, plugin_result, start_script

#: The exit status the agent sees when it SIGKILLs a cancelled script's process group.
KILLED = 137
#: What a simulated invocation's script writes, in bytes: more than the agent keeps of either
#: stream (24,000 characters of stdout, 8,000 of stderr: ssm_agent/__init__.py), so that
#: every answer carries the most a real invocation's does: 2,500 characters of `Output` in
#: ListCommandInvocations (iohandler.go, with the agent's truncation marks) and the whole
#: StandardOutputContent of GetCommandInvocation.
SIMULATED_STDOUT = 32_000
SIMULATED_STDERR = 12_000


def simulated_output(instance: Instance, document: str, size: int, stream: str) -> bytes:
    """Lines of a node script's log (lib.sh's `log`: an ISO time, the node, the message) up to
    `size` bytes: as long as the agent's limits need, and no shorter than a real one's."""
    lines = []
    total, n = 0, 0
    while total < size:
        line = (
            f"2026-11-25T00:00:{n % 60:02d}Z {instance.address} {document} {stream}: step {n} "
            f"of the node's check on {instance.instance_id}, status so far ok\n"
        )
        lines.append(line)
        total, n = total + len(line), n + 1
    return "".join(lines).encode()[:size]


FAKE_IP = """#!/usr/bin/env bash
if [[ "$*" == "-o -4 addr show" ]]; then
  echo "1: lo    inet 127.0.0.1/8 scope host lo"
  echo "2: ens5    inet __ADDRESS__/16 brd __BROADCAST__ scope global ens5"
  exit 0
fi
exec /usr/sbin/ip "$@"
"""
FAKE_NEURON_LS = """#!/usr/bin/env bash
[[ "$1" == -j ]] || exit 2
cat "$REHEARSAL_NODE_DIR/neuron-ls.json"
"""
#: torchrun's stand-in: it reports its start (its arguments, in <command>.started) and exits
#: with the status the rehearsal writes to <command>.exit (SSM_COMMAND_ID: the agent's).
FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$REHEARSAL_NODE_DIR/$SSM_COMMAND_ID.started.tmp"
mv "$REHEARSAL_NODE_DIR/$SSM_COMMAND_ID.started.tmp" "$REHEARSAL_NODE_DIR/$SSM_COMMAND_ID.started"
until [[ -f $REHEARSAL_NODE_DIR/$SSM_COMMAND_ID.exit ]]; do sleep 0.2; done
exit "$(cat "$REHEARSAL_NODE_DIR/$SSM_COMMAND_ID.exit")"
"""


class _Agent:
    """Stands for a node's running agent process (Instance.online asks it)."""

    @staticmethod
    def poll() -> None:
        return None


class SimulatedHosts:
    """`count` addresses in 10.X.0.0/16 (no namespaces), X from 128 to 254 drawn for each
    rehearsal. launch.sh on a node stops what any job left on its address and a node's death
    kills what is tagged with it, both only in the node's own state folder
    (TRAINIUM_STATE_DIR), so two rehearsals that draw the same network keep to their own
    processes."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.network = f"10.{128 + secrets.randbelow(127)}"
        self.broadcast = f"{self.network}.255.255"
        self.addresses = [f"{self.network}.{slot // 250}.{slot % 250 + 4}" for slot in range(count)]

    def close(self) -> None:
        pass


class SimulatedInstances(Instances):
    """Instances with a spool folder each and nothing running on them; those in `real_slots`
    get a node's files for launch.sh (`lay_out_real`)."""

    #: The slots whose nodes run RunTraining for real (set before the instances launch).
    real_slots: frozenset[int] = frozenset()
    #: NeuronCores a real node reports (fake neuron-ls): launch.sh starts as many ranks.
    real_cores = 16

    def __init__(self, hosts: SimulatedHosts, output: Path, ids: Any, **_: Any) -> None:
        self.hosts = hosts  # type: ignore[assignment]
        self.broadcast = hosts.broadcast
        self.output = output
        self.ids = ids
        self.cluster_name = str(_.get("cluster_name", "rehearsal"))
        self.node_settings: dict[str, str] = {}
        self.software_version = software_version()
        self.instances: list[Instance] = []
        self.died: list[Instance] = []
        for slot in range(hosts.count):
            self.instances.append(self.launch(slot))

    def launch(self, slot: int) -> Instance:
        instance_id = f"i-{next(self.ids):017x}"
        instance = Instance(
            slot, instance_id, self.hosts.addresses[slot], self.output / instance_id
        )
        for folder in ("commands", "cancel"):
            (instance.spool / folder).mkdir(parents=True, exist_ok=True)
        instance.agent = _Agent()  # type: ignore[assignment]
        if slot in self.real_slots:
            self.lay_out_real(instance)
        return instance

    def lay_out_real(self, instance: Instance) -> None:
        """The node's files launch.sh reads: cluster.env, the ready marker, a log folder, and
        fake ip, neuron-ls and torchrun first on PATH."""
        root = instance.root
        for folder in ("bin", "state", "log", "fsx"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        # /fsx/data is the data bucket's, the same on every node (the job's code snapshot).
        shared = self.output / "data"
        shared.mkdir(parents=True, exist_ok=True)
        if not (root / "fsx" / "data").is_symlink():
            (root / "fsx" / "data").symlink_to(shared)
        ip = FAKE_IP.replace("__ADDRESS__", instance.address)
        tools = {"ip": ip.replace("__BROADCAST__", self.broadcast),
                 "neuron-ls": FAKE_NEURON_LS, "torchrun": FAKE_TORCHRUN}  # fmt: skip
        for name, text in tools.items():
            (root / "bin" / name).write_text(text)
            (root / "bin" / name).chmod(0o755)
        devices = [{"neuron_device": n, "nc_count": 1, "neuron_processes": []}
                   for n in range(self.real_cores)]  # fmt: skip
        (root / "neuron-ls.json").write_text(json.dumps(devices))
        settings = {
            "CLUSTER_NAME": self.cluster_name, "INSTANCE_TYPE": "trn1.32xlarge",
            "NODE_COUNT": str(self.hosts.count), "FSX_MOUNT_POINT": str(root / "fsx"),
            "NEURON_VENV": str(root / "no-venv"),
            "SOFTWARE_VERSION": self.software_version,
        }  # fmt: skip
        (root / "cluster.env").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        (root / "state" / "ready").write_text("ready (scale rehearsal node)\n")

    def real_environment(self, instance: Instance, env: dict[str, str]) -> dict[str, str]:
        """The agent's environment, with the node's files where a node has them."""
        root = instance.root
        return {**env, "PATH": f"{root / 'bin'}:{env['PATH']}", "REHEARSAL_NODE_DIR": str(root),
                "TRAINIUM_CLUSTER_ENV": str(root / "cluster.env"),
                "TRAINIUM_STATE_DIR": str(root / "state"),
                "TRAINIUM_LOG_DIR": str(root / "log"),
                "TRAINIUM_CODE_CACHE": str(root / "code-cache"),
                "TRAINIUM_ENV_CACHE": str(root / "env-cache"),
                "TRAINIUM_PRECOMPILE_DIR": str(root / "precompile")}  # fmt: skip

    def terminate(self, instance: Instance) -> None:
        instance.state = "terminated"

    def close(self) -> None:
        for instance in self.instances:
            instance.state = "terminated"


@dataclass
class _Running:
    folder: Path
    instance: Instance
    document: str
    started: float


@dataclass
class _Real:
    """A real node's RunTraining: the script the agent started, until torchrun reports."""

    key: str
    command_id: str
    invocation: Any
    script: AgentScript
    started: float
    ending: str = ""


@dataclass
class SimulatedAgents:
    """Answers the invocations SendCommand delivers to the simulated fleet (see the module's
    docstring); `launched` holds, per RunTraining command, when each node started it (a real
    node: when its torchrun started)."""

    instances: SimulatedInstances
    running: dict[str, _Running] = field(default_factory=dict)
    launched: dict[str, dict[str, float]] = field(default_factory=dict)
    real: dict[str, _Real] = field(default_factory=dict)
    #: The instances whose agent no longer answers (`hang`).
    hung: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event)
    #: The stand-in's lock of API answers (LocalCloud.answering, once attached): `finish`
    #: ends a batch under it, so no ListCommandInvocations sees the batch half ended.
    _answering: threading.Lock = field(default_factory=threading.Lock)
    #: The real nodes whose end `finish` makes known with their batch: None until the
    #: script has exited, then its invocation's folder and the status its exit gives (None:
    #: the node no longer runs).
    _held: dict[str, tuple[Path, dict[str, Any] | None] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)
        threading.Thread(target=self._watch_real, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for item in list(self.real.values()):
            item.script.kill()

    def attach(self, cloud: Any) -> None:
        """Answers what `cloud`'s SSM stand-in sends, as each node's agent would."""
        ssm = cloud.ssm
        send, cancel = ssm._ssm_SendCommand, ssm._ssm_CancelCommand
        self._answering = cloud.answering

        def send_and_start(params: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = send(params)
            command = ssm.commands[answer["Command"]["CommandId"]]
            for invocation in command.invocations.values():
                if invocation.failure or invocation.instance.state != "running":
                    continue
                self._start(command.command_id, command.document, invocation)
            return answer

        def cancel_and_kill(params: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = cancel(params)
            command = ssm.commands[params["CommandId"]]
            for instance_id in params.get("InstanceIds") or list(command.invocations):
                self._end(f"{command.command_id}-{instance_id}", KILLED, ending="cancel")
            return answer

        ssm._ssm_SendCommand = send_and_start
        ssm._ssm_CancelCommand = cancel_and_kill

    def _start(self, command_id: str, document: str, invocation: Any) -> None:
        key = f"{command_id}-{invocation.instance.instance_id}"
        invocation.folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        _write(invocation.folder / "status.json", {"status": "InProgress", "started": now})
        instance = invocation.instance
        if document.endswith("RunTraining") and instance.slot in self.instances.real_slots:
            spec = json.loads((instance.spool / "commands" / f"{key}.json").read_text())
            # The document runs the scripts where a node has them installed.
            script = spec["script"].replace(
                f"{INSTALL_ROOT}/scripts/node/", f"{REPO_ROOT / 'scripts' / 'node'}/"
            )
            env = self.instances.real_environment(instance, spec["env"])
            started = start_script(script, invocation.folder, env, copier=Path(spec["copier"]))
            with self._changed:
                self.real[key] = _Real(key, command_id, invocation, started, now)
            return
        with self._changed:
            self.running[key] = _Running(invocation.folder, invocation.instance, document, now)
            if document.endswith("RunTraining"):
                self.launched.setdefault(command_id, {})[invocation.instance.instance_id] = now
            self._changed.notify_all()
        if not document.endswith("RunTraining"):
            self._end(key, 0)

    def _watch_real(self) -> None:
        """The real nodes' scripts: a node counts as launched once its torchrun reported; an
        ended script's status is what the agent makes of its exit (plugin_result)."""
        while not self._stop.wait(0.2):
            for key, item in list(self.real.items()):
                instance = item.invocation.instance
                started = instance.root / f"{item.command_id}.started"
                if started.is_file() and key not in self.running:
                    with self._changed:
                        self.running[key] = _Running(
                            item.invocation.folder, instance, "RunTraining", item.started
                        )
                        self.launched.setdefault(item.command_id, {})[instance.instance_id] = (
                            time.time()
                        )
                        self._changed.notify_all()
                code = item.script.poll()
                if code is None:
                    continue
                ended = None
                if instance.state == "running":
                    status, details, code = plugin_result(code, item.ending)
                    ended = {"status": status, "details": details, "code": code,
                             "started": item.started, "ended": time.time()}  # fmt: skip
                with self._changed:
                    if key in self._held:  # finish writes it with the batch's others
                        self._held[key] = (item.invocation.folder, ended)
                    elif ended is not None:
                        _write(item.invocation.folder / "status.json", ended)
                    self.real.pop(key, None)
                    self.running.pop(key, None)
                    self._changed.notify_all()

    def _tell(self, key: str, code: int) -> bool:
        """A real node's torchrun exits with `code`; False when the node is not real."""
        item = self.real.get(key)
        if item is None:
            return False
        root = item.invocation.instance.root
        # Written whole, then renamed: the stand-in reads the file as soon as it exists, and a
        # file created but not yet written reads empty (`exit ""` in bash is status 2, which
        # launch.sh reports as 1: a job failed at random, more often the busier the machine).
        _write_text(root / f"{item.command_id}.exit", f"{code}\n")
        return True

    def _end(self, key: str, code: int, *, ending: str = "") -> None:
        if any(key.endswith(instance_id) for instance_id in self.hung):
            return
        real = self.real.get(key)
        if real is not None:
            if ending:  # the agent's SIGKILL to the script's process group
                real.ending = ending
                real.script.kill()
            else:
                self._tell(key, code)
            return
        with self._changed:
            item = self.running.pop(key, None)
            self._changed.notify_all()
        if item is None or item.instance.state != "running":
            return
        status, details, code = plugin_result(code, ending)
        ended = {"status": status, "details": details, "code": code, "ended": time.time()}
        for stream, size in (("stdout", SIMULATED_STDOUT), ("stderr", SIMULATED_STDERR)):
            data = simulated_output(item.instance, item.document, size, stream)
            (item.folder / stream).write_bytes(data)
        _write(item.folder / "status.json", {**ended, "started": item.started})

    def training(self) -> list[str]:
        """The keys of the RunTraining invocations running on live nodes."""
        with self._lock:
            return [
                key
                for key, item in self.running.items()
                if item.document.endswith("RunTraining") and item.instance.state == "running"
            ]

    def wait_launched(
        self, count: int, timeout: float, *, after: frozenset[str] = frozenset()
    ) -> frozenset[str]:
        """Waits until `count` live nodes run RunTraining from commands not in `after` (an
        attempt sends one command per batch of 50); returns those commands' IDs. `timeout` is
        an upper bound only."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                commands = {c for c in self.launched if c not in after}
                nodes = {
                    item.instance.instance_id
                    for key, item in self.running.items()
                    if item.instance.state == "running" and key[:36] in commands
                    and item.document.endswith("RunTraining")
                }  # fmt: skip
                if len(nodes) >= count:
                    return frozenset(commands)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(nodes)} of {count} nodes run RunTraining")
                self._changed.wait(min(left, 1.0))

    def finish(self, timeout: float = 300.0) -> None:
        """Every running trainer ends well (launch.sh's status 0), each batch's invocations
        at once: the first invocation of a batch (one SendCommand) to end starts its
        FailureGraceSeconds for the rest (5 s in the scale rehearsal), after which the
        supervisor cancels whatever still runs and the attempt fails ("RunTraining ended
        Cancelled"). So a batch ends under the stand-in's lock of API answers, and no
        ListCommandInvocations sees it half ended, however long its 50 ends take (on a busy
        machine, among a rehearsal's thousands of threads, 50 one after the other took more
        than the grace). A real node's invocation ends only once launch.sh has wound down:
        the real nodes are told first, their ends are held back, and a batch with real nodes
        ends (theirs too) as soon as their scripts have exited; then every other batch, one
        after the other. `timeout` is an upper bound only."""
        keys = self.training()
        real = [key for key in keys if key in self.real]
        batches: dict[str, list[str]] = {}
        for key in keys:
            batches.setdefault(key[:36], []).append(key)  # <command ID>-<instance ID>
        with self._changed:
            self._held.update(dict.fromkeys(real))
        for key in real:
            self._tell(key, 0)
        deadline = time.monotonic() + timeout
        while True:
            with self._changed:
                while True:
                    waiting = [key for key in real if key in self.real]
                    due = [
                        command
                        for command in {key[:36] for key in real} & batches.keys()
                        if not any(key.startswith(command) for key in waiting)
                    ]
                    if due or not waiting:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{len(waiting)} real nodes still run RunTraining")
                    self._changed.wait(min(left, 1.0))
            for command in due:
                self._end_batch(batches.pop(command))
            if not waiting:
                break
        for mates in batches.values():
            self._end_batch(mates)

    def _end_batch(self, keys: list[str]) -> None:
        """Ends a batch's invocations well, all under the lock of API answers: the simulated
        nodes now, a real node (its script has exited) with the status its exit gave."""
        with self._answering:
            for key in keys:
                if key not in self._held:
                    self._end(key, 0)
                    continue
                with self._changed:
                    exited = self._held.pop(key)
                if exited is not None and exited[1] is not None:
                    _write(exited[0] / "status.json", exited[1])

    def fail(self, instance: Instance, code: int = 1) -> None:
        """The node's RunTraining ends with `code` (1: torchrun failed)."""
        for key in self.training():
            if key.endswith(instance.instance_id):
                self._end(key, code)

    def real_instances(self) -> list[Instance]:
        return [i for i in self.instances.running() if i.slot in self.instances.real_slots]

    def hang(self, instance: Instance) -> None:
        """The instance stops answering (a kernel or hardware hang) but still runs, as EC2
        and Auto Scaling see it until a health check fails: its invocations never end, and a
        cancel is never acknowledged (SSM reports it Cancelling). `die` ends it later."""
        if instance.slot in self.instances.real_slots:
            raise ValueError("only a simulated node hangs")
        self.hung.add(instance.instance_id)

    def die(self, instance: Instance) -> Instance:
        """The instance dies: its invocations never end (a real node's processes are killed);
        the group launches a replacement."""
        self.instances.died.append(instance)
        if instance.slot in self.instances.real_slots:
            instance.state = "terminated"
            for item in list(self.real.values()):
                if item.invocation.instance is instance:
                    item.script.kill()
            kill_pids(tagged_pids(None, instance.address, instance.root / "state"))
        replacement: Instance = self.instances.replace(instance)
        return replacement


def _write(path: Path, value: dict[str, Any]) -> None:
    _write_text(path, json.dumps(value))


def _write_text(path: Path, text: str) -> None:
    """`text` in `path`, which a reader sees whole or not at all."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)
