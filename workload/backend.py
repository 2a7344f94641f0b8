"""Device selection and distributed setup: one ``Backend`` object for xla, cuda and cpu.

Everything device-specific in the trainer goes through this object, so the training loop
reads the same on a laptop (cpu, gloo), a GPU box (cuda, NCCL) and a Trainium node
(xla through torch-neuronx / torch-xla 2.9).

torch-xla is imported lazily, only when the xla backend is chosen, and only through its
current API: ``torch_xla.device()``, ``torch_xla.sync()``, ``torch_xla.runtime`` and the
``xla://`` init method (no ``xm.xla_device``, ``xm.mark_step``, ``xm.xrt_world_size``,
``xm.get_ordinal`` or ``XLA_USE_BF16``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import logging
import os
import random
import shlex
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "xla")
PRECISION_CHOICES = ("auto", "bf16", "fp32")

#: Environment variables that decide how the Neuron compiler and runtime treat the job; the
#: launcher sets them and the trainer logs what is in force.
NEURON_ENV_VARS = (
    "NEURON_CC_FLAGS",
    "NEURON_RT_STOCHASTIC_ROUNDING_EN",
    "NEURON_RT_STOCHASTIC_ROUNDING_SEED",
    "NEURON_COMPILE_CACHE_URL",
    "NEURON_EXTRACT_GRAPHS_ONLY",
    "NEURON_RT_ROOT_COMM_ID",
    "NEURON_RT_VISIBLE_CORES",
    "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
    "XLA_IR_DEBUG",
)


class BackendError(RuntimeError):
    """A device or distributed-setup problem, reported to the user in one line."""


def graphs_only() -> bool:
    """True under ``neuron_parallel_compile``: graphs are traced and compiled, not executed.

    Tensor values are meaningless in that mode, so the trainer skips anything that depends
    on them (checkpoints, reported metrics).
    """
    return os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "").strip() not in ("", "0")


def neuron_environment() -> dict[str, str]:
    """The Neuron/EFA settings in force (only those that are set)."""
    return {name: os.environ[name] for name in NEURON_ENV_VARS if name in os.environ}


def _neuron_present() -> bool:
    return Path("/dev/neuron0").exists() or importlib.util.find_spec("torch_neuronx") is not None


def _torch_xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def resolve_device_kind(requested: str) -> str:
    """Turn ``--device`` into one of cpu, cuda, xla; ``auto`` picks the best present."""
    if requested not in DEVICE_CHOICES:
        raise BackendError(f"--device {requested!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise BackendError("--device cuda: no CUDA device is visible to this process")
    if requested == "xla" and not _torch_xla_installed():
        raise BackendError("--device xla: torch-xla is not installed in this Python environment")
    if requested != "auto":
        return requested
    # XLA only when it is clearly wanted: a Neuron device, or PJRT_DEVICE set by the user.
    # A laptop that merely has torch-xla installed still trains eagerly.
    from . import PJRT_DEVICE_AT_START

    if _torch_xla_installed() and (PJRT_DEVICE_AT_START or _neuron_present()):
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass
class Backend:
    """The device, the process's place in the job, and the device-specific operations."""

    kind: str  # "xla", "cuda" or "cpu"
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    #: dtype for ``torch.autocast`` (bf16) or None for full fp32.
    autocast_dtype: torch.dtype | None = None
    #: Under xla: the PJRT device type ("NEURON", "CPU", "CUDA", "TPU").
    xla_device_type: str | None = None
    #: Host-side coordination over gloo (barriers, flags, small Python objects), so that
    #: bookkeeping never puts a collective (and a compilation) into the device graph: one
    #: group over all ranks on cpu and cuda, a ``NodeTree`` under xla. None alone.
    control: Control | None = None
    owns_process_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def precision(self) -> str:
        return "bf16" if self.autocast_dtype == torch.bfloat16 else "fp32"

    @property
    def description(self) -> str:
        if self.kind == "xla":
            return f"xla:{self.xla_device_type}"
        if self.kind == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)}"
        return "cpu"

    # -- graph and timing ------------------------------------------------------------------

    def sync(self) -> None:
        """Cut and launch the pending XLA graph (``torch_xla.sync()``); no-op elsewhere."""
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def wait(self) -> None:
        """Block until queued device work is done (for honest wall-clock timing)."""
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()
        elif self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    def compile_count(self) -> int | None:
        """Graph compilations so far in this process (xla), else None."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        return int(met.counter_value("UncachedCompile") or 0)

    def host_transfers(self) -> int | None:
        """Device-to-host transfers so far in this process (xla), else None."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        data = met.metric_data("TransferFromDeviceTime")
        return int(data[0]) if data else 0

    def executions(self) -> int | None:
        """Graphs launched so far in this process (xla), else None: counted when traced
        and sent (``TensorsGraphSize``), not when the asynchronous execution finishes."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        data = met.metric_data("TensorsGraphSize")
        return int(data[0]) if data else 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision for forward passes: bf16 autocast where chosen, else nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.kind, dtype=self.autocast_dtype)

    # -- model, gradients, data ------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move to the device; wrap in DDP for multi-process cuda/cpu (xla all-reduces in
        ``optimizer_step`` instead).

        Parameters the model shares (GPT-2's LM head is its input embedding) stay shared:
        ``Module._apply`` makes a new Parameter for each name when the CPU and XLA tensor
        types cannot swap in place, which unties them; so under xla they are tied again
        after the move (``tie_weights()``, as transformers' Trainer does after moving a
        model to an XLA device, then any sharing it did not restore), before the optimizer
        and the start-up broadcast see the parameters."""
        shared = shared_parameters(model)
        model = model.to(self.device)
        if self.kind == "xla" and shared:
            retie(model, shared)
        if self.kind != "xla" and self.world_size > 1:
            device_ids = [self.device.index] if self.kind == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        return model

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank, so that identical weights do not
        rest on identical seeded initialisation alone. On xla ``xm.broadcast_master_param``
        (one graph at start; the per-rank scale is device data, so every rank traces the
        same graph); on cuda/cpu DDP broadcasts when it wraps the model."""
        if self.kind == "xla" and self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(model)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare model under a DDP wrapper."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        parameters: Iterable[torch.Tensor],
        max_grad_norm: float,
    ) -> None:
        """All-reduce gradients (xla), clip them to ``max_grad_norm`` (0 = off), step.

        Under xla this is ``xm.optimizer_step``; with clipping it is the same two halves
        (``xm.reduce_gradients`` then ``optimizer.step()``) with the clip in between, so
        that the norm is taken over the all-reduced gradients. DDP has already all-reduced
        during backward on cuda/cpu.
        """
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm

            if max_grad_norm > 0:
                xm.reduce_gradients(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
                optimizer.step()
            else:
                xm.optimizer_step(optimizer)
            return
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        optimizer.step()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over all ranks (returns the reduced tensor)."""
        if self.world_size == 1:
            return tensor
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm

            reduced = xm.all_reduce(xm.REDUCE_SUM, tensor)
            assert isinstance(reduced, torch.Tensor)
            return reduced
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def device_loader(
        self, loader: Iterable[Mapping[str, torch.Tensor]]
    ) -> Iterable[Mapping[str, torch.Tensor]]:
        """Batches on the device: ``MpDeviceLoader`` under xla (background host-to-device
        transfer overlapped with tracing), a plain move elsewhere."""
        if self.kind == "xla":
            from torch_xla.distributed.parallel_loader import MpDeviceLoader

            return MpDeviceLoader(loader, self.device)
        return _ToDevice(loader, self.device)

    # -- host-side coordination ------------------------------------------------------------

    def barrier(self) -> None:
        if self.control is not None:
            self.control.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        return [obj] if self.control is None else self.control.all_gather_object(obj)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank: host-side all-reduces over
        the control groups (gloo), so nothing enters the device graph."""
        return flag if self.control is None else self.control.any_rank(flag)

    def start_any_rank(self, flag: bool) -> Callable[[], bool]:
        """``any_rank`` started now and answered later: returns the function that waits for
        the answer. The ranks must start (and read) their votes at the same points, as they
        do every collective; other coordination may run while a vote is in flight."""
        return (lambda: flag) if self.control is None else self.control.start_any_rank(flag)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj if self.control is None else self.control.broadcast_object(obj)

    def from_node_leader(self, obj: Any) -> Any:
        """The ``obj`` of this node's local rank 0 on every rank of the node."""
        return obj if self.control is None else self.control.from_node_leader(obj)

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0, None elsewhere: what only rank 0
        needs (the RNG states it saves) reaches no other rank."""
        return [obj] if self.control is None else self.control.gather_object(obj)

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """Rank 0's ``objs[r]`` on rank r (``objs`` is read on rank 0 only)."""
        if self.control is None:
            assert objs is not None
            return objs[0]
        return self.control.scatter_object(objs)

    # -- randomness ------------------------------------------------------------------------

    def seed(self, seed: int) -> None:
        """Seed every generator this process uses (host, CUDA, XLA device)."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        if self.kind == "xla":
            import torch_xla

            torch_xla.manual_seed(seed)

    def seed_step(self, seed: int, step: int) -> None:
        """Seed the XLA device generator (dropout) for training step ``step`` from ``seed``,
        this rank and the step; called right before each step. Every ``torch_xla.sync()``,
        even an empty one, advances the device seed (torch-xla's
        ``XLAGraphExecutor::DeviceContextArena::MarkStep``), and the loader syncs once more
        between a save and the next step when the save was at an epoch's last step than a
        resume from that save does, so a device seed carried in the checkpoint would give
        the resumed run other dropout masks than the run that never stopped. The seed
        enters the graph as device data, so every step traces the same graph. cpu and cuda
        need nothing: their generators advance only with the work, and the checkpoint
        carries their states."""
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(step_seed(seed, self.rank, step), str(self.device))

    def rng_state(self) -> dict[str, Any]:
        """This process's generator states, as plain Python objects and CPU tensors."""
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if self.kind == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm

            state["xla"] = int(xm.get_rng_state(str(self.device)))
        return state

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``rng_state`` returned (missing device entries are left alone)."""
        random.setstate(_as_tuple(state["python"]))
        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["kind"],
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
        torch.set_rng_state(state["torch"])
        if self.kind == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
        if self.kind == "xla" and "xla" in state:
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(state["xla"]), str(self.device))

    def close(self) -> None:
        """Leave the process groups while the interpreter is still whole.

        ``destroy_process_group`` drops only the registry's references. A group that a
        Python handle still reaches (``control``'s groups; a DDP wrapper's reducer, which
        sits in reference cycles) keeps its gloo worker threads and transport until the
        interpreter's finalization, and gloo's teardown there ends the process in
        std::terminate now and then ("terminate called without an active exception",
        status -6: a rank that trained and saved reported as failed; 6 of 270 ranks of the
        vote rehearsal with the handle kept, 0 of 270 with it dropped). So the handles go
        first and the cycles are collected: each group is torn down here, its threads
        joined (tests/test_workload_close.py counts them)."""
        self.control = None
        gc.collect()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


_MASK64 = 2**64 - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def step_seed(seed: int, rank: int, step: int) -> int:
    """A device seed for (seed, rank, step), below 2**63: splitmix64 over the three, so
    that neighbouring steps and ranks get unrelated streams."""
    value = 0
    for part in (seed, rank, step):
        value = _splitmix64(value ^ (part & _MASK64))
    return value >> 1


def shared_parameters(model: nn.Module) -> dict[str, str]:
    """{name: the first name of the same Parameter} for every parameter the model reaches
    under more than one name (tied weights)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def retie(model: nn.Module, shared: Mapping[str, str]) -> None:
    """Share again what ``shared`` (``shared_parameters`` before a move) says was shared:
    the model's own ``tie_weights()`` first, then every alias it left apart."""
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    for alias, owner in shared.items():
        param = model.get_parameter(owner)
        if model.get_parameter(alias) is not param:
            module_name, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(module_name), leaf, param)


class Control:
    """Host-side coordination of all ranks over gloo: what ``Backend`` needs of it."""

    def barrier(self) -> None:
        raise NotImplementedError

    def any_rank(self, flag: bool) -> bool:
        raise NotImplementedError

    def start_any_rank(self, flag: bool) -> Callable[[], bool]:
        raise NotImplementedError

    def broadcast_object(self, obj: Any) -> Any:
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def from_node_leader(self, obj: Any) -> Any:
        raise NotImplementedError

    def gather_object(self, obj: Any) -> list[Any] | None:
        raise NotImplementedError

    def scatter_object(self, objs: list[Any] | None) -> Any:
        raise NotImplementedError


class OneGroup(Control):
    """One group over all ranks (cpu: the gloo world itself; cuda: a gloo group beside
    NCCL's). gloo connects every pair of a group's ranks, one socket per peer."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group
        self.world_size = world_size

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def any_rank(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def start_any_rank(self, flag: bool) -> Callable[[], bool]:
        # One collective: gloo runs a group's collectives in the order they were issued
        # (each takes the group's next tag), so later ones may be issued while it is out.
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None

        def answer() -> bool:
            work.wait()
            return bool(value.item())

        return answer

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def from_node_leader(self, obj: Any) -> Any:
        # One group over all ranks has no node groups (cpu and cuda: jobs of a few nodes).
        rank = dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        return self.all_gather_object(obj)[rank - local_rank]

    def gather_object(self, obj: Any) -> list[Any] | None:
        main = dist.get_rank() == 0
        gathered: list[Any] | None = [None] * self.world_size if main else None
        dist.gather_object(obj, gathered, dst=0, group=self.group)
        return gathered

    def scatter_object(self, objs: list[Any] | None) -> Any:
        box: list[Any] = [None]
        sent = objs if dist.get_rank() == 0 else None
        dist.scatter_object_list(box, sent, src=0, group=self.group)
        return box[0]


class NodeTree(Control):
    """Coordination without a group over all ranks: a gloo group per node (its local
    ranks) and one of the nodes' local rank 0s, the leaders; each operation goes up the
    node, across the leaders and back down. A group over all ranks would be a full mesh
    (one socket per peer in every process: 32 x nodes on trn1.32xlarge, past the open-file
    limit and the rendezvous' reach at a few thousand ranks); here a process has
    local ranks - 1 peers, a leader nodes - 1 more.

    torchrun numbers ranks node by node (rank = node rank x local world size + local
    rank), so a node's ranks are the local world size from ``rank - local_rank``. Only a
    group's members create it (``use_local_synchronization``): every node its own group,
    then the leaders theirs, in that order on every rank.

    ``start_any_rank`` runs its three all-reduces (up, across, down: each needs the one
    before) in a thread of its own; every other operation first waits for that thread, so
    each group sees its collectives in the same order on every rank.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        timeout: datetime.timedelta,
    ) -> None:
        if local_world_size < 1 or world_size % local_world_size:
            raise BackendError(
                f"a world of {world_size} ranks is not whole nodes of {local_world_size} "
                "processes: start the same number of processes on every node"
            )
        self.world_size = world_size
        self.leader = rank - local_rank
        self.is_leader = local_rank == 0
        self.node = None
        if local_world_size > 1:
            self.node = dist.new_group(
                list(range(self.leader, self.leader + local_world_size)),
                backend="gloo",
                timeout=timeout,
                use_local_synchronization=True,
            )
        self.leaders = None
        leaders = list(range(0, world_size, local_world_size))
        if self.is_leader and len(leaders) > 1:
            self.leaders = dist.new_group(
                leaders, backend="gloo", timeout=timeout, use_local_synchronization=True
            )
        self._vote: threading.Thread | None = None

    def _settle(self) -> None:
        """Wait for the vote in flight (its answer stays with its reader)."""
        if self._vote is not None:
            self._vote.join()
            self._vote = None

    def barrier(self) -> None:
        self._settle()
        if self.node is not None:
            dist.barrier(group=self.node)
        if self.leaders is not None:
            dist.barrier(group=self.leaders)
        if self.node is not None:
            dist.barrier(group=self.node)

    def any_rank(self, flag: bool) -> bool:
        self._settle()
        return self._any_rank_now(flag)

    def start_any_rank(self, flag: bool) -> Callable[[], bool]:
        self._settle()
        result: dict[str, Any] = {}

        def vote() -> None:
            try:
                result["value"] = self._any_rank_now(flag)
            except BaseException as exc:  # raised where the answer is read
                result["error"] = exc

        thread = threading.Thread(target=vote, name="any-rank vote", daemon=True)
        thread.start()
        self._vote = thread

        def answer() -> bool:
            thread.join()
            if self._vote is thread:
                self._vote = None
            if "error" in result:
                raise result["error"]
            return bool(result["value"])

        return answer

    def _any_rank_now(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        for group in (self.node, self.leaders, self.node):
            if group is not None:
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())

    def broadcast_object(self, obj: Any) -> Any:
        self._settle()
        box = [obj]
        if self.leaders is not None:
            dist.broadcast_object_list(box, src=0, group=self.leaders)
        return self._from_leader(box[0])

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._settle()
        node: list[Any] = [obj]
        if self.node is not None:
            node = [None] * dist.get_world_size(self.node)
            dist.all_gather_object(node, obj, group=self.node)
        if self.leaders is None:
            return self._from_leader(node) if self.world_size > len(node) else node
        nodes: list[Any] = [None] * dist.get_world_size(self.leaders)
        dist.all_gather_object(nodes, node, group=self.leaders)
        return self._from_leader([item for per_node in nodes for item in per_node])

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Up the node to its leader, then across the leaders to rank 0."""
        self._settle()
        node: list[Any] | None = [obj]
        if self.node is not None:
            node = [None] * dist.get_world_size(self.node) if self.is_leader else None
            dist.gather_object(obj, node, dst=self.leader, group=self.node)
        if not self.is_leader:
            return None
        if self.leaders is None:
            return node
        nodes: list[Any] | None = None
        if self.leader == 0:
            nodes = [None] * dist.get_world_size(self.leaders)
        dist.gather_object(node, nodes, dst=0, group=self.leaders)
        return None if nodes is None else [item for per_node in nodes for item in per_node]

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """Across the leaders (a node's share each), then down each node."""
        self._settle()
        share: Any = objs
        if self.leaders is not None:
            box: list[Any] = [None]
            chunks = None
            if self.leader == 0:
                assert objs is not None
                size = len(objs) // dist.get_world_size(self.leaders)
                chunks = [objs[i : i + size] for i in range(0, len(objs), size)]
            dist.scatter_object_list(box, chunks, src=0, group=self.leaders)
            share = box[0]
        if self.node is None:
            assert share is not None
            return share[0]
        mine: list[Any] = [None]
        dist.scatter_object_list(
            mine, share if self.is_leader else None, src=self.leader, group=self.node
        )
        return mine[0]

    def from_node_leader(self, obj: Any) -> Any:
        self._settle()
        return self._from_leader(obj)

    def _from_leader(self, obj: Any) -> Any:
        """The node leader's ``obj`` on every rank of the node."""
        if self.node is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader, group=self.node)
        return box[0]


def _as_tuple(value: Any) -> Any:
    """``random.setstate`` wants nested tuples; a checkpoint round trip may give lists."""
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


class _ToDevice:
    """Move each batch to the device (pinned, non-blocking copies on cuda)."""

    def __init__(self, loader: Iterable[Mapping[str, torch.Tensor]], device: torch.device):
        self.loader = loader
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Mapping[str, torch.Tensor]]:
        non_blocking = self.device.type == "cuda"
        for batch in self.loader:
            yield {k: v.to(self.device, non_blocking=non_blocking) for k, v in batch.items()}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _resolve_precision(
    precision: str, kind: str, xla_device_type: str | None
) -> torch.dtype | None:
    if precision not in PRECISION_CHOICES:
        raise BackendError(
            f"--precision {precision!r} is not one of {', '.join(PRECISION_CHOICES)}"
        )
    if precision == "fp32":
        return None
    cuda_bf16 = kind == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "bf16":
        if kind == "cuda" and not cuda_bf16:
            raise BackendError("--precision bf16: this CUDA device does not support bf16")
        return torch.bfloat16
    # auto: bf16 on accelerators that have fast bf16 units; fp32 on CPUs (eager or XLA).
    if cuda_bf16 or (kind == "xla" and xla_device_type in ("NEURON", "TPU", "CUDA")):
        return torch.bfloat16
    return None


def _import_before_groups() -> None:
    """Import torch._dynamo before any process group exists.

    Its import, when it first happens after ``init_process_group`` (DDP's constructor
    imports it), takes 10 references to the default group that nothing releases (counted
    with ``sys.getrefcount`` across that line of torch 2.9's DDP): ``Backend.close`` then
    cannot tear the group down, and gloo's teardown at the interpreter's exit ends a rank
    in std::terminate now and then (see ``close``)."""
    import torch._dynamo  # noqa: F401


def _without_torch_xla() -> None:
    """Keep transformers and accelerate from importing torch-xla in a cpu or cuda process.

    Both import ``torch_xla.core.xla_model`` when they are first imported and torch-xla is
    installed, unless ``USE_TORCH_XLA`` is false (accelerate's ``utils/imports.py`` and
    transformers' ``utils/import_utils.py`` read it then; accelerate's documented switch "to
    train a native pytorch job in an environment with torch xla installed"). The import costs
    about 1.7 CPU-s (5.5 against 3.9 CPU-s, ``/usr/bin/time python -c 'import
    transformers.models.bert.modeling_bert'`` with and without it), sets ``PJRT_DEVICE=CPU``
    and warns so, and lets a ``Trainer`` move the model to the XLA device. Set here, before
    train.py or bench.py imports transformers; a value the user set is kept."""
    os.environ.setdefault("USE_TORCH_XLA", "0")


def setup_backend(
    device: str = "auto",
    precision: str = "auto",
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
) -> Backend:
    """Pick the device, join the process group when started by torchrun, return a Backend.

    Rank, local rank and world size come from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE); without it the job is a single process.
    """
    kind = resolve_device_kind(device)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    env_world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)

    if kind == "xla":
        return _setup_xla(precision, launched, env_world, local_world, timeout)
    _without_torch_xla()

    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    backend = Backend(
        kind=kind,
        device=torch_device,
        local_rank=local_rank,
        local_world_size=local_world,
        autocast_dtype=_resolve_precision(precision, kind, None),
    )
    if launched:
        _import_before_groups()
        dist.init_process_group(
            "nccl" if kind == "cuda" else "gloo",
            timeout=timeout,
            device_id=torch_device if kind == "cuda" else None,
        )
        backend.owns_process_group = True
        backend.rank = dist.get_rank()
        backend.world_size = dist.get_world_size()
        if backend.world_size > 1:
            backend.control = OneGroup(
                dist.new_group(backend="gloo", timeout=timeout)
                if kind == "cuda"
                else dist.group.WORLD,
                backend.world_size,
            )
    return backend


def _setup_xla(
    precision: str,
    launched: bool,
    env_world: int,
    local_world: int,
    timeout: datetime.timedelta,
) -> Backend:
    import torch_xla
    import torch_xla.distributed.xla_backend  # registers the "xla" process-group backend
    import torch_xla.runtime as xr

    owns = False
    if launched:
        _import_before_groups()
        dist.init_process_group("xla", init_method="xla://", timeout=timeout)
        owns = True
    world = xr.world_size()
    if launched and world != env_world:
        device_type = xr.device_type()
        if owns:
            dist.destroy_process_group()
        raise BackendError(
            f"torchrun started {env_world} processes but the XLA runtime "
            f"(PJRT_DEVICE={device_type}) sees a world of {world}: torch-xla's "
            f"{device_type} client cannot run collectives across processes; "
            "start one process (--nproc_per_node=1) for XLA on CPU"
        )
    backend = Backend(
        kind="xla",
        device=torch_xla.device(),
        rank=xr.global_ordinal(),
        world_size=world,
        local_rank=xr.local_ordinal(),
        local_world_size=local_world,
        xla_device_type=xr.device_type(),
        owns_process_group=owns,
    )
    backend.autocast_dtype = _resolve_precision(precision, "xla", backend.xla_device_type)
    if launched and world > 1:
        backend.control = NodeTree(backend.rank, world, backend.local_rank, local_world, timeout)
    flags = os.environ.get("NEURON_CC_FLAGS", "")
    try:
        check_compiler_precision(flags, backend.precision)
    except BackendError:
        if owns:
            dist.destroy_process_group()
        raise
    if backend.xla_device_type == "NEURON" and compiler_autocast(flags) is None:
        log.warning(
            "NEURON_CC_FLAGS has no --auto-cast (Neuron 2.27+ defaults to none, earlier "
            "releases to matmult); the launcher sets --auto-cast=none"
        )
    return backend


def compiler_autocast(flags: str) -> str | None:
    """The ``--auto-cast`` value in ``NEURON_CC_FLAGS`` (the last one wins), or None."""
    value = None
    words = shlex.split(flags)
    for index, word in enumerate(words):
        if word.startswith("--auto-cast="):
            value = word.split("=", 1)[1]
        elif word == "--auto-cast" and index + 1 < len(words):
            value = words[index + 1]
    return value


def check_compiler_precision(flags: str, precision: str) -> None:
    """Refuse compiler auto-casting: ``--precision`` is the one precision decision.

    With torch autocast (bf16) Neuron's guidance is ``--auto-cast=none`` (the migration
    note from XLA_DOWNCAST_BF16; optimum-neuron does the same). ``--auto-cast=all`` would
    also cast LayerNorm, softmax, the loss, the AdamW update (fp32 master weights in effect
    bf16) and the evaluation sums; ``matmult`` under ``--precision fp32`` would make the
    run bf16 behind the flag's back. So any value but ``none`` is refused.
    """
    value = compiler_autocast(flags)
    if value not in (None, "none"):
        raise BackendError(
            f"NEURON_CC_FLAGS has --auto-cast={value}, which conflicts with --precision "
            f"{precision}: precision is set by --precision alone (bf16 = torch autocast with "
            "fp32 weights, optimizer and sums); the only --auto-cast allowed is none"
        )
