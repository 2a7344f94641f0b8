"""The one table of instance facts that the stacks, the operator scripts and the cost model read.

Add an instance type here and every other piece (EFA interface count, nproc per node,
MFU peak, cost estimates) follows. Prices are Linux on-demand in us-east-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

#: When the on-demand prices below were taken from the EC2 pricing pages.
PRICES_AS_OF = "2025-06-30"
PRICE_REGION = "us-east-1"


@dataclass(frozen=True)
class InstanceTypeSpec:
    """Hardware facts of one EC2 instance type."""

    name: str
    accelerator: str  # "trainium", "trainium2", "a100", "h100"
    accelerators: int  # chips (Trainium) or GPUs
    #: Devices a training process binds to: NeuronCores (Trainium) or GPUs. torchrun
    #: starts this many processes per node.
    devices: int
    accelerator_memory_gib: int
    vcpus: int
    memory_gib: int
    network_gbps: float
    #: Network cards that carry an EFA interface (0 = no EFA, so no multi-node training).
    efa_interfaces: int
    #: Whether the cards after card 0 take `efa-only` interfaces (EFA device, no ENA device and
    #: no private IP address): EC2's guidance for instance types with several network cards,
    #: "Maximize network bandwidth on Amazon EC2 instances with multiple network cards"
    #: (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html), where
    #: DescribeInstanceTypes lists `efa-only` among each card's InterfaceTypes.
    efa_only_interfaces: bool
    #: NVMe instance store volumes and the size of each, in GB (0 = none), as
    #: DescribeInstanceTypes gives them (InstanceStorageInfo.Disks) and the EC2 docs' "Instance
    #: store volume limits" table (https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html).
    instance_store_volumes: int
    instance_store_volume_gb: int
    #: Dense bf16 peak per device, in TFLOP/s (the MFU denominator).
    bf16_tflops_per_device: float
    #: On-demand $/h in PRICE_REGION, or None where no price was published when taken.
    on_demand_usd_per_hour: float | None
    #: Regions that offer the type (EC2's DescribeInstanceTypeOfferings, as moto's EC2 data
    #: carries it; tests/test_instance_types_data.py checks every field it covers); empty where
    #: not tracked (the GPU baselines). The cluster config refuses other regions; the first is
    #: where the stack tests synthesize the type.
    regions: tuple[str, ...] = ()

    @property
    def is_trainium(self) -> bool:
        return self.accelerator.startswith("trainium")

    @property
    def supports_multi_node(self) -> bool:
        return self.efa_interfaces > 0

    @property
    def instance_store_gb(self) -> int:
        return self.instance_store_volumes * self.instance_store_volume_gb

    @property
    def peak_bf16_tflops(self) -> float:
        return self.bf16_tflops_per_device * self.devices


INSTANCE_TYPES: MappingProxyType[str, InstanceTypeSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            InstanceTypeSpec(
                name="trn1.2xlarge",
                accelerator="trainium",
                accelerators=1,
                devices=2,
                accelerator_memory_gib=32,
                vcpus=8,
                memory_gib=32,
                network_gbps=12.5,
                efa_interfaces=0,
                efa_only_interfaces=False,
                instance_store_volumes=1,
                instance_store_volume_gb=474,
                bf16_tflops_per_device=95.0,
                on_demand_usd_per_hour=1.34,
                regions=("us-east-1", "us-east-2", "us-west-2"),
            ),
            InstanceTypeSpec(
                name="trn1.32xlarge",
                accelerator="trainium",
                accelerators=16,
                devices=32,
                accelerator_memory_gib=512,
                vcpus=128,
                memory_gib=512,
                network_gbps=800,
                efa_interfaces=8,
                efa_only_interfaces=True,
                instance_store_volumes=4,
                instance_store_volume_gb=1900,
                bf16_tflops_per_device=95.0,
                on_demand_usd_per_hour=21.50,
                regions=(
                    "us-east-1",
                    "us-east-2",
                    "us-west-2",
                    "ap-south-1",
                    "ap-southeast-2",
                    "ap-southeast-4",
                ),
            ),
            InstanceTypeSpec(
                name="trn1n.32xlarge",
                accelerator="trainium",
                accelerators=16,
                devices=32,
                accelerator_memory_gib=512,
                vcpus=128,
                memory_gib=512,
                network_gbps=1600,
                efa_interfaces=16,
                efa_only_interfaces=True,
                instance_store_volumes=4,
                instance_store_volume_gb=1900,
                bf16_tflops_per_device=95.0,
                on_demand_usd_per_hour=24.78,
                regions=("us-east-1", "us-east-2", "us-west-2"),
            ),
            InstanceTypeSpec(
                name="trn2.48xlarge",
                accelerator="trainium2",
                accelerators=16,
                # 8 physical NeuronCores per chip, exposed as 4 logical cores at the
                # default logical-NeuronCore size of 2.
                devices=64,
                accelerator_memory_gib=1536,
                vcpus=192,
                memory_gib=2048,
                network_gbps=3200,
                efa_interfaces=16,
                efa_only_interfaces=True,
                instance_store_volumes=4,
                instance_store_volume_gb=1900,
                bf16_tflops_per_device=166.75,  # 667 TFLOP/s dense bf16 per chip / 4
                on_demand_usd_per_hour=None,
                regions=("us-east-2", "ap-south-2"),
            ),
            InstanceTypeSpec(
                name="p4d.24xlarge",
                accelerator="a100",
                accelerators=8,
                devices=8,
                accelerator_memory_gib=320,
                vcpus=96,
                memory_gib=1152,
                network_gbps=400,
                efa_interfaces=4,
                efa_only_interfaces=True,
                instance_store_volumes=8,
                instance_store_volume_gb=1000,
                bf16_tflops_per_device=312.0,
                on_demand_usd_per_hour=32.77,
            ),
            InstanceTypeSpec(
                name="p5.48xlarge",
                accelerator="h100",
                accelerators=8,
                devices=8,
                accelerator_memory_gib=640,
                vcpus=192,
                memory_gib=2048,
                network_gbps=3200,
                efa_interfaces=32,
                efa_only_interfaces=True,
                instance_store_volumes=8,
                instance_store_volume_gb=3800,
                bf16_tflops_per_device=989.0,
                on_demand_usd_per_hour=55.04,
            ),
        )
    }
)

#: The instance types a cluster can be built from (the rest are cost-comparison baselines).
CLUSTER_INSTANCE_TYPES = tuple(name for name, s in INSTANCE_TYPES.items() if s.is_trainium)
