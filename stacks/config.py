"""The cluster's settings: one frozen, validated dataclass built from CDK context.

`ClusterConfig.from_context` is called once, in app.py, before any construct is made. Every
value from `cdk.json` or `npx cdk synth -c key=value` is parsed and checked here, so the stacks
never see a bad value and a user never sees a traceback: a `ConfigError` carries one line that
names the key, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from stacks.bucket_names import bucket_name_problem
from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES, InstanceTypeSpec

#: The default `ami`: the Neuron DLAMI of the training release named under `image` in
#: scripts/node/neuron_releases.json, the newest such image in the stack's region, found at the
#: first deploy and kept by later ones (stacks/node_image.py). Neuron publishes SSM parameters
#: for the latest DLAMI of each type only, and the PyTorch 2.9 one below is frozen at Neuron
#: 2.31.x, which no longer trains with PyTorch/XLA: the nodes refuse its image.
NEURON_RELEASE_AMI = "neuron-release"
DEFAULT_AMI_PARAMETER = "/aws/service/neuron/dlami/pytorch-2.9/ubuntu-24.04/latest/image_id"

#: Availability Zone IDs (not names: names differ between accounts) of a zone that offers trn1
#: in the regions this project has been checked against. Other regions need an explicit az_id.
DEFAULT_AZ_IDS: Mapping[str, str] = {
    "us-east-1": "use1-az6",
    "us-east-2": "use2-az3",
    "us-west-2": "usw2-az4",
}

#: Tags that the operator tooling uses to find a cluster's nodes.
CLUSTER_TAG_KEY = "trainium-cluster:name"
ROLE_TAG_KEY = "trainium-cluster:role"
WORKER_ROLE = "worker"

#: The largest cluster: 32,768 NeuronCores of trn1.32xlarge, one Auto Scaling group in one
#: placement group. Every per-node and per-rank resource of the launch path is sized for it:
#: the supervisor's payloads and history (stacks/supervisor_limits.py), the group read in
#: pages and batches (stacks/supervisor_group.py), the host list (16,383 characters, the
#: RunTraining document's Hosts), the open-file limit of the scripts (scripts/node/lib.sh).
MAX_NODES = 1024
#: The most instances one EC2 Capacity Block holds ("Capacity Blocks ... in cluster sizes of
#: one to 64 instances", Amazon EC2 user guide, Capacity Blocks for ML).
CAPACITY_BLOCK_MAX_NODES = 64
FSX_MIN_GIB = 1200  # PERSISTENT_2 SSD: 1200 GiB, then steps of 2400 GiB
FSX_STEP_GIB = 2400
FSX_MAX_GIB = 2400 * 200  # a guard against typos (480 TiB), well above any default quota
FSX_THROUGHPUTS = (125, 250, 500, 1000)  # PERSISTENT_2 tiers, MB/s per TiB of storage
ROOT_VOLUME_MIN_GIB = 100  # the Neuron DLAMI's root snapshot does not fit in less
ROOT_VOLUME_MAX_GIB = 16384  # the largest gp3 volume
INTERNET_EGRESS_CHOICES = ("nat", "endpoints")
#: How long a job may wait for a full set of InService, healthy nodes (node_wait_hours): from
#: an hour (a node replacement takes up to the 45-minute launch lifecycle timeout) to a week.
NODE_WAIT_MAX_HOURS = 7 * 24
#: EC2 starts terminating a Capacity Block's instances 30 minutes before the block ends, and the
#: Auto Scaling guide says to scale the group to zero before that ("Use Capacity Blocks for
#: machine learning workloads", Operational guidelines:
#: https://docs.aws.amazon.com/autoscaling/ec2/userguide/launch-template-capacity-blocks.html).
CAPACITY_BLOCK_RECLAIM_MINUTES = 30
#: Scale-in lead time: at least the reclaim window plus 5 minutes for Auto Scaling to act.
DRAIN_MIN_MINUTES = CAPACITY_BLOCK_RECLAIM_MINUTES + 5
DRAIN_MAX_MINUTES = 24 * 60
#: The longest idle_warning_minutes: a week.
IDLE_WARNING_MAX_MINUTES = 7 * 24 * 60
_PRICE_RE = re.compile(r"^\d{1,6}(?:\.\d{1,4})?$")
#: The format of capacity_block_start/end (UTC), as CloudFormation's scheduled actions take it.
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
#: The retention periods CloudWatch Logs accepts, in days.
LOG_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922,
    3288, 3653,
)  # fmt: skip

_CLUSTER_NAME_RE = re.compile(r"^[a-z](?:[a-z0-9-]{0,22}[a-z0-9])?$")
_REGION_RE = re.compile(
    r"^[a-z]{2}(-gov)?-(north|south|east|west|central|northeast|southeast|northwest|southwest)-\d$"
)
_AZ_ID_RE = re.compile(r"^([a-z]+\d+)-az\d+$")
_AMI_ID_RE = re.compile(r"^ami-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_SSM_PARAMETER_RE = re.compile(r"^(?:/[A-Za-z0-9_.-]+)+$")
_CAPACITY_RESERVATION_RE = re.compile(r"^cr-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
#: EC2 placement group names: up to 255 ASCII characters; this project allows the safe subset.
_PLACEMENT_GROUP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_EMAIL_RE = re.compile(r"^[^@\s,;'\"]+@[^@\s,;'\"]+\.[A-Za-z]{2,}$")
_TRUE = ("true", "yes", "1", "on")
_FALSE = ("false", "no", "0", "off")
_DIRECTIONS = {
    "north": "n",
    "south": "s",
    "east": "e",
    "west": "w",
    "central": "c",
    "northeast": "ne",
    "southeast": "se",
    "northwest": "nw",
    "southwest": "sw",
}


class ConfigError(ValueError):
    """A setting the cluster cannot be built from; the message is one line for the user."""


def az_id_prefix(region: str) -> str:
    """Prefix of a region's Availability Zone IDs: us-east-1 -> use1, us-gov-west-1 -> usgw1."""
    parts = region.split("-")
    if parts[1] == "gov":
        return f"{parts[0]}g{_DIRECTIONS[parts[2]]}{parts[3]}"
    return f"{parts[0]}{_DIRECTIONS[parts[1]]}{parts[2]}"


def _setting(default: Any, allowed: str) -> Any:
    """A settable field; `allowed` is what error messages tell the user."""
    return field(default=default, metadata={"allowed": allowed})


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Everything that varies between clusters. The defaults are the ones in cdk.json."""

    #: Prefix of the stack names, value of the cluster tag, part of physical names.
    cluster_name: str = _setting(
        "trainium", "1-24 lowercase letters, digits and '-', starting with a letter"
    )
    region: str = _setting("us-east-1", "an AWS region name such as us-east-1")
    #: Availability Zone ID of the one subnet that all nodes share (EFA needs one subnet).
    #: Empty: the trn1 zone of the region from DEFAULT_AZ_IDS.
    az_id: str = _setting("", "an Availability Zone ID of the region, such as use1-az6")
    instance_type: str = _setting("trn1.32xlarge", ", ".join(CLUSTER_INSTANCE_TYPES))
    node_count: int = _setting(2, f"1 to {MAX_NODES}")
    #: Warm spares: the group runs node_count + spare_nodes nodes, all bootstrapped; a job runs
    #: on node_count of them and a retry after a node's death starts on a spare at once.
    spare_nodes: int = _setting(
        0,
        f"0 or more, with node_count + spare_nodes at most {MAX_NODES} (at most "
        f"{CAPACITY_BLOCK_MAX_NODES} with capacity_block=true)",
    )
    #: The table's Neuron DLAMI (found at the first deploy), a pinned AMI ID, or an SSM
    #: parameter resolved at every deploy.
    ami: str = _setting(
        NEURON_RELEASE_AMI,
        f"{NEURON_RELEASE_AMI} (the Neuron DLAMI of scripts/node/neuron_releases.json's "
        "release, found at the first deploy), an AMI ID (ami- and 8 or 17 hex digits) or an SSM "
        "parameter path such as " + DEFAULT_AMI_PARAMETER,
    )
    fsx_storage_gib: int = _setting(
        FSX_MIN_GIB, f"{FSX_MIN_GIB} or a multiple of {FSX_STEP_GIB} (2400, 4800, ...)"
    )
    fsx_throughput_per_tib: int = _setting(
        250, f"{', '.join(map(str, FSX_THROUGHPUTS))} (MB/s per TiB)"
    )
    root_volume_gib: int = _setting(512, f"{ROOT_VOLUME_MIN_GIB} to {ROOT_VOLUME_MAX_GIB}")
    #: A targeted On-Demand Capacity Reservation or Capacity Block, or empty for none.
    capacity_reservation_id: str = _setting("", "cr- and 8 or 17 hex digits, or empty for none")
    #: True when capacity_reservation_id is a Capacity Block for ML.
    capacity_block: bool = _setting(False, "true or false")
    #: The Capacity Block's start and end (UTC): the group scales to node_count at the start and
    #: to 0 capacity_block_drain_minutes before the end.
    capacity_block_start: str = _setting(
        "", "the block's start time in UTC, such as 2026-12-01T11:30:00Z, or empty"
    )
    capacity_block_end: str = _setting(
        "", "the block's end time in UTC, such as 2026-12-08T11:30:00Z, or empty"
    )
    capacity_block_drain_minutes: int = _setting(
        60,
        f"{DRAIN_MIN_MINUTES} to {DRAIN_MAX_MINUTES} (EC2 reclaims a block's instances from "
        f"{CAPACITY_BLOCK_RECLAIM_MINUTES} minutes before its end)",
    )
    #: An existing cluster placement group to launch into (the one an On-Demand Capacity
    #: Reservation was made in); empty: the stack creates one (none with a Capacity Block).
    placement_group_name: str = _setting(
        "", "the name of an existing cluster placement group, or empty to create one"
    )
    #: nat: a NAT gateway gives the nodes internet egress; endpoints: VPC endpoints only.
    internet_egress: str = _setting(
        "nat", "nat (a NAT gateway) or endpoints (VPC endpoints only, no internet)"
    )
    #: Keep the data and checkpoint buckets (and their access logs) on `cdk destroy`.
    retain_data: bool = _setting(True, "true or false")
    #: Address that alarms are mailed to (an SNS email subscription), or empty for none.
    alarm_email: str = _setting("", "one address such as ops@example.com, or empty for none")
    #: How long the training and VPC flow log groups keep events.
    log_retention_days: int = _setting(365, ", ".join(map(str, LOG_RETENTION_DAYS)))
    #: How long one job waits, in all, for a full set of node_count InService, healthy nodes
    #: before it fails (the job supervisor: no capacity, a Capacity Block scaled to 0).
    node_wait_hours: int = _setting(
        24, f"1 to {NODE_WAIT_MAX_HOURS} (hours a job waits for a full set of nodes)"
    )

    # Kept data adopted by a new deploy: the buckets a destroyed cluster of this name kept
    # (retain_data=true), imported by the storage stack instead of new, empty buckets, so that
    # the next cluster sees the old data and jobs (docs/deploy.md, "Deploying again").
    #: The data bucket to adopt (linked to /fsx/data), or empty: the stack creates one.
    data_bucket_name: str = _setting(
        "", "the name of an existing S3 bucket in the region (a kept data bucket), or empty"
    )
    #: The checkpoint bucket to adopt (linked to /fsx/jobs), or empty: the stack creates one.
    checkpoint_bucket_name: str = _setting(
        "", "the name of an existing S3 bucket in the region (a kept checkpoint bucket), or empty"
    )
    # What the nodes cost (`cluster.py jobs` and `status`, scripts/cluster_lib/costs.py) -------
    #: USD per node-hour: empty for the instance type's on-demand price (stacks/instance_types.py);
    #: a reservation's or a Capacity Block's own rate. EC2 quotes a Capacity Block as one upfront
    #: fee for its instances and hours (EC2 API reference, CapacityBlockOffering: upfrontFee,
    #: instanceCount, capacityBlockDurationHours): its rate is upfrontFee / (instances x hours).
    node_usd_per_hour: str = _setting(
        "",
        "empty (the instance type's on-demand price) or USD per node-hour such as 21.50 (a "
        "Capacity Block: its upfront fee / (instances x hours))",
    )
    #: Nodes up with no job for longer than this: `jobs` and `status` warn (0: never).
    idle_warning_minutes: int = _setting(
        60, f"0 (no warning) to {IDLE_WARNING_MAX_MINUTES} (minutes nodes are up with no job)"
    )

    #: The facts of instance_type, from stacks/instance_types.py.
    instance: InstanceTypeSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._require(bool(_CLUSTER_NAME_RE.match(self.cluster_name)), "cluster_name")
        self._require(bool(_REGION_RE.match(self.region)), "region")
        self._require(
            self.instance_type in CLUSTER_INSTANCE_TYPES, "instance_type", "not supported"
        )
        object.__setattr__(self, "instance", INSTANCE_TYPES[self.instance_type])
        az_id_given = bool(self.az_id)
        if self.instance.regions and self.region not in self.instance.regions:
            raise ConfigError(
                f"instance_type={self.instance_type} is not offered in region={self.region}; "
                f"allowed: region {' or '.join(self.instance.regions)}"
            )
        self._check_az_id()
        self._require(1 <= self.node_count <= MAX_NODES, "node_count", "out of range")
        if self.node_count > 1 and not self.instance.supports_multi_node:
            with_efa = [t for t in CLUSTER_INSTANCE_TYPES if INSTANCE_TYPES[t].supports_multi_node]
            raise ConfigError(
                f"node_count={self.node_count} is not allowed with instance_type="
                f"{self.instance_type}: nodes talk over EFA and {self.instance_type} has no EFA "
                f"interface; allowed: node_count=1, or instance_type {', '.join(with_efa)}"
            )
        self._require(
            self.ami == NEURON_RELEASE_AMI
            or bool(_AMI_ID_RE.match(self.ami) or _SSM_PARAMETER_RE.match(self.ami)),
            "ami",
            f"neither {NEURON_RELEASE_AMI}, an AMI ID nor an SSM parameter path",
        )
        self._require(
            FSX_MIN_GIB <= self.fsx_storage_gib <= FSX_MAX_GIB
            and (self.fsx_storage_gib == FSX_MIN_GIB or self.fsx_storage_gib % FSX_STEP_GIB == 0),
            "fsx_storage_gib",
            "not a size FSx for Lustre PERSISTENT_2 (SSD) allows",
        )
        self._require(
            self.fsx_throughput_per_tib in FSX_THROUGHPUTS,
            "fsx_throughput_per_tib",
            "not a PERSISTENT_2 throughput tier",
        )
        self._require(
            ROOT_VOLUME_MIN_GIB <= self.root_volume_gib <= ROOT_VOLUME_MAX_GIB,
            "root_volume_gib",
            "out of range",
        )
        self._require(
            not self.capacity_reservation_id
            or bool(_CAPACITY_RESERVATION_RE.match(self.capacity_reservation_id)),
            "capacity_reservation_id",
            "not a capacity reservation ID",
        )
        if self.capacity_block and not self.capacity_reservation_id:
            raise ConfigError(
                "capacity_block=true is not allowed without a reservation; allowed: "
                "capacity_block=true together with capacity_reservation_id=<the block's cr- ID>"
            )
        if self.capacity_block and self.node_count > CAPACITY_BLOCK_MAX_NODES:
            raise ConfigError(
                f"node_count={self.node_count} is not allowed with capacity_block=true: a "
                f"Capacity Block holds at most {CAPACITY_BLOCK_MAX_NODES} instances; allowed: "
                f"node_count 1 to {CAPACITY_BLOCK_MAX_NODES} with capacity_block=true, or up to "
                f"{MAX_NODES} On-Demand or in a capacity reservation (capacity_block=false)"
            )
        self._check_spares()
        self._check_capacity(az_id_given)
        self._require(self.internet_egress in INTERNET_EGRESS_CHOICES, "internet_egress")
        if self.internet_egress == "endpoints" and not _AMI_ID_RE.match(self.ami):
            raise ConfigError(
                f"internet_egress=endpoints is not allowed with ami={self.ami}: with no internet "
                "the nodes cannot install the Lustre client or Python packages, which the stock "
                f"Neuron DLAMI (ami={NEURON_RELEASE_AMI}, the default) lacks, and an SSM "
                "parameter may move to another image; allowed: a pinned ami-... that carries all "
                "software, or internet_egress=nat"
            )
        self._require(
            not self.alarm_email or bool(_EMAIL_RE.match(self.alarm_email)),
            "alarm_email",
            "not an email address",
        )
        self._require(
            self.log_retention_days in LOG_RETENTION_DAYS,
            "log_retention_days",
            "not a retention CloudWatch Logs offers",
        )
        self._require(
            1 <= self.node_wait_hours <= NODE_WAIT_MAX_HOURS, "node_wait_hours", "out of range"
        )
        self._check_adopted_buckets()
        self._check_costs()

    def _check_adopted_buckets(self) -> None:
        """Adopted bucket names: S3's naming rules (stacks/bucket_names.py), two buckets."""
        for key in ("data_bucket_name", "checkpoint_bucket_name"):
            name = getattr(self, key)
            problem = bucket_name_problem(name) if name else None
            if problem:
                raise ConfigError(f"{key}={name!r} is {problem}; allowed: {_allowed(key)}")
        if self.data_bucket_name and self.data_bucket_name == self.checkpoint_bucket_name:
            raise ConfigError(
                f"data_bucket_name and checkpoint_bucket_name are both {self.data_bucket_name}: "
                "/fsx/data and /fsx/jobs would link to one bucket's root; allowed: the two "
                "different buckets a cluster kept"
            )

    def _check_spares(self) -> None:
        """Spares are instances like the job's: they count against MAX_NODES (every per-node
        resource of the launch path is sized for it) and against a Capacity Block's size."""
        self._require(self.spare_nodes >= 0, "spare_nodes", "out of range")
        limit, where = MAX_NODES, "a cluster"
        if self.capacity_block:
            limit, where = CAPACITY_BLOCK_MAX_NODES, "a Capacity Block"
        if self.group_size > limit:
            raise ConfigError(
                f"node_count={self.node_count} with spare_nodes={self.spare_nodes} is "
                f"{self.group_size} instances, more than {where} holds ({limit}); allowed: "
                f"node_count + spare_nodes at most {limit}"
            )

    @property
    def group_size(self) -> int:
        """The Auto Scaling group's size: the job's nodes and the warm spares."""
        return self.node_count + self.spare_nodes

    def _check_costs(self) -> None:
        self._require(
            not self.node_usd_per_hour
            or (
                bool(_PRICE_RE.match(self.node_usd_per_hour)) and float(self.node_usd_per_hour) > 0
            ),
            "node_usd_per_hour",
            "not a price",
        )
        self._require(
            0 <= self.idle_warning_minutes <= IDLE_WARNING_MAX_MINUTES,
            "idle_warning_minutes",
            "out of range",
        )

    @property
    def node_price(self) -> float | None:
        """USD per node-hour: the setting, else the on-demand price (None where unknown)."""
        if self.node_usd_per_hour:
            return float(self.node_usd_per_hour)
        return self.instance.on_demand_usd_per_hour

    def _check_capacity(self, az_id_given: bool) -> None:
        """Reservations, Capacity Blocks and placement groups: only combinations that launch."""
        self._require(
            not self.placement_group_name
            or bool(_PLACEMENT_GROUP_RE.match(self.placement_group_name)),
            "placement_group_name",
            "not a placement group name",
        )
        if self.capacity_reservation_id and not az_id_given:
            raise ConfigError(
                f"capacity_reservation_id={self.capacity_reservation_id} needs an explicit az_id: "
                "a reservation serves one Availability Zone and the nodes' subnet must be in it; "
                "allowed: az_id=<the reservation's zone ID>, such as "
                f"{DEFAULT_AZ_IDS.get(self.region, az_id_prefix(self.region) + '-az1')}"
            )
        block_times = {k: getattr(self, k) for k in ("capacity_block_start", "capacity_block_end")}
        if not self.capacity_block:
            given = [k for k, v in block_times.items() if v]
            if given:
                raise ConfigError(
                    f"{given[0]}={block_times[given[0]]} is only used with a Capacity Block; "
                    "allowed: capacity_block=true with capacity_reservation_id, or "
                    f"{given[0]} empty"
                )
            if self.capacity_reservation_id and not self.placement_group_name:
                raise ConfigError(
                    f"capacity_reservation_id={self.capacity_reservation_id} needs "
                    "placement_group_name: an On-Demand Capacity Reservation for trn capacity is "
                    "made in a cluster placement group and serves only instances launched into "
                    "that group, so a new group would never use it; allowed: "
                    "placement_group_name=<the reservation's placement group>"
                )
            return
        if self.placement_group_name:
            raise ConfigError(
                f"placement_group_name={self.placement_group_name} is not allowed with "
                "capacity_block=true: a Capacity Block places its instances itself (EC2 "
                "UltraClusters) and launches into no placement group; allowed: "
                "placement_group_name empty"
            )
        times = {}
        for key, value in block_times.items():
            if not value:
                raise ConfigError(
                    f"capacity_block=true needs {key}: the group starts at 0 and scheduled "
                    f"actions scale it at the block's start and before its end; allowed: "
                    f"{_allowed(key)}"
                )
            try:
                times[key] = datetime.strptime(value, TIME_FORMAT).replace(tzinfo=UTC)
            except ValueError:
                raise ConfigError(
                    f"{key}={value!r} is not a UTC time; allowed: {_allowed(key)}"
                ) from None
        self._require(
            DRAIN_MIN_MINUTES <= self.capacity_block_drain_minutes <= DRAIN_MAX_MINUTES,
            "capacity_block_drain_minutes",
            "out of range",
        )
        start, end = times["capacity_block_start"], times["capacity_block_end"]
        if end - start <= timedelta(minutes=self.capacity_block_drain_minutes):
            raise ConfigError(
                f"capacity_block_end={self.capacity_block_end} leaves no time after "
                f"capacity_block_start={self.capacity_block_start} once the group scales in "
                f"capacity_block_drain_minutes={self.capacity_block_drain_minutes} before the "
                "end; allowed: an end later than the start by more than the drain minutes"
            )

    @property
    def capacity_block_scale_out_time(self) -> str:
        """When the group scales to node_count: the block's start (UTC, TIME_FORMAT)."""
        return self.capacity_block_start

    @property
    def capacity_block_scale_in_time(self) -> str:
        """When the group scales to 0: capacity_block_drain_minutes before the block's end."""
        end = datetime.strptime(self.capacity_block_end, TIME_FORMAT)
        return (end - timedelta(minutes=self.capacity_block_drain_minutes)).strftime(TIME_FORMAT)

    def _require(self, ok: bool, key: str, problem: str = "not allowed") -> None:
        if not ok:
            raise ConfigError(
                f"{key}={getattr(self, key)!r} is {problem}; allowed: {_allowed(key)}"
            )

    def _check_az_id(self) -> None:
        if not self.az_id:
            if self.region not in DEFAULT_AZ_IDS:
                raise ConfigError(
                    f"az_id is required for region={self.region} (no default zone is known "
                    f"there); allowed: a zone ID of {self.region} that offers "
                    f"{self.instance_type}, such as {az_id_prefix(self.region)}-az1, or a region "
                    f"with a default: {', '.join(DEFAULT_AZ_IDS)}"
                )
            object.__setattr__(self, "az_id", DEFAULT_AZ_IDS[self.region])
        match = _AZ_ID_RE.match(self.az_id)
        prefix = az_id_prefix(self.region)
        if not match:
            raise ConfigError(
                f"az_id={self.az_id!r} is not an Availability Zone ID (IDs are the same in every "
                f"account, names such as {self.region}a are not); allowed: a zone ID of "
                f"{self.region}, such as {DEFAULT_AZ_IDS.get(self.region, prefix + '-az1')}"
            )
        if match.group(1) != prefix:
            raise ConfigError(
                f"az_id={self.az_id!r} is not in region={self.region}; allowed: a zone ID of "
                f"{self.region} (starting with {prefix}-az), such as "
                f"{DEFAULT_AZ_IDS.get(self.region, prefix + '-az1')}"
            )

    # Names derived from the settings, kept in one place.

    @property
    def auto_scaling_group_name(self) -> str:
        """A physical name, so that the operations stack can watch the group it does not own."""
        return f"{self.cluster_name}-workers"

    @property
    def lifecycle_hook_name(self) -> str:
        """The group's launch lifecycle hook, which bootstrap.sh completes (cluster.env)."""
        return f"{self.cluster_name}-bootstrap"

    @property
    def metrics_namespace(self) -> str:
        """CloudWatch namespace that the nodes publish their neuron-monitor metrics under."""
        return f"TrainiumCluster/{self.cluster_name}"

    def stack_name(self, part: str) -> str:
        return f"{self.cluster_name}-{part}"

    @classmethod
    def from_context(
        cls, get: Callable[[str], Any], present_keys: Iterable[str] = ()
    ) -> ClusterConfig:
        """Build the config from CDK context: `get` is `app.node.try_get_context`.

        `present_keys` are all context keys; a snake_case key that is no setting (a typo such as
        `node_cout`) is refused rather than silently ignored. CDK's own keys contain ':' or '@'.
        """
        settable = {f.name: f for f in fields(cls) if f.init}
        for key in present_keys:
            if re.fullmatch(r"[a-z][a-z0-9_]*", key) and key not in settable:
                close = difflib.get_close_matches(key, settable, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{key} is not a setting{hint}; allowed: {', '.join(settable)}")
        values = {}
        for name, f in settable.items():
            raw = get(name)
            if raw is not None:
                values[name] = _parse(name, raw, f.default)
        return cls(**values)


def _allowed(key: str) -> str:
    return str(next(f.metadata["allowed"] for f in fields(ClusterConfig) if f.name == key))


def _parse(key: str, raw: object, default: object) -> Any:
    """Turn one context value into the type of its field.

    Values from cdk.json arrive as JSON types; values from `-c key=value` are always strings.
    """
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(f"{key}={raw!r} is not a boolean; allowed: {_allowed(key)}")
    if isinstance(default, int):
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        text = str(raw).strip()
        if isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        raise ConfigError(f"{key}={raw!r} is not a whole number; allowed: {_allowed(key)}")
    if not isinstance(raw, str):
        raise ConfigError(f"{key}={raw!r} is not a string; allowed: {_allowed(key)}")
    return raw.strip()
