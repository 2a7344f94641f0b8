"""The cost model: how much a run trains (``Work``), an instance type that runs it
(``Candidate``), its time and cost (``Estimate``), the main candidate against another
(``Comparison``, break-even throughput), and the whole answer (``Report``).

Prices and hardware facts come from stacks/instance_types.py; SageMaker ``ml.*`` types share
the facts of their EC2 type but need their price given.
"""

from __future__ import annotations

from dataclasses import dataclass

from scripts.cost_lib import EstimateError
from scripts.cost_lib.checkpoints import CheckpointPlan
from stacks.instance_types import (
    INSTANCE_TYPES,
    PRICE_REGION,
    PRICES_AS_OF,
    InstanceTypeSpec,
)

#: Throughput units: optimizer steps, samples or tokens per second.
UNITS = ("it/s", "samples/s", "tokens/s")
#: The unit of work that one unit of throughput moves.
_WORK_OF_UNIT = {"it/s": "steps", "samples/s": "samples", "tokens/s": "tokens"}
SAGEMAKER_PREFIX = "ml."


@dataclass(frozen=True)
class Work:
    """How much a run trains, in whichever unit the user knows it."""

    amount: float | None  # None: unknown (only a measured time is given)
    unit: str  # "steps", "samples" or "tokens"
    batch_size: int | None  # global samples per step
    tokens_per_sample: float | None

    def convert(self, amount: float, src: str, dst: str) -> float | None:
        """Convert between steps, samples and tokens; None where a factor is missing."""
        if src == dst:
            return amount
        samples = amount
        if src == "steps":
            if self.batch_size is None:
                return None
            samples = amount * self.batch_size
        elif src == "tokens":
            if not self.tokens_per_sample:
                return None
            samples = amount / self.tokens_per_sample
        if dst == "samples":
            return samples
        if dst == "steps":
            return None if self.batch_size is None else samples / self.batch_size
        return None if not self.tokens_per_sample else samples * self.tokens_per_sample

    @property
    def samples(self) -> float | None:
        return None if self.amount is None else self.convert(self.amount, self.unit, "samples")

    @property
    def tokens(self) -> float | None:
        return None if self.amount is None else self.convert(self.amount, self.unit, "tokens")


@dataclass(frozen=True)
class Candidate:
    """One instance type running the work: what it costs per hour and how fast it goes."""

    instance_type: str
    spec: InstanceTypeSpec
    nodes: int
    usd_per_node_hour: float
    price_overridden: bool
    throughput: float | None  # in the run's throughput unit
    seconds: float | None  # measured training time, overrides work / throughput
    compile_seconds: float  # graph compilation with a cold cache, billed on every node


@dataclass(frozen=True)
class Estimate:
    """Time and money for one candidate (JSON field names are part of the interface)."""

    instance_type: str
    accelerator: str
    nodes: int
    usd_per_node_hour: float
    price_source: str
    throughput: float | None
    throughput_unit: str
    train_seconds: float
    compile_seconds: float
    cache: str
    total_seconds: float
    instance_hours: float
    cost_usd: float
    cost_warm_cache_usd: float
    cost_cold_cache_usd: float
    warm_cache_saving_usd: float
    cost_per_million_samples_usd: float | None
    cost_per_million_tokens_usd: float | None


@dataclass(frozen=True)
class Comparison:
    """The main candidate against another instance type."""

    instance_type: str
    speedup: float | None  # throughput ratio main / other (>1: main is faster)
    time_ratio: float  # main time / other time (<1: main finishes sooner)
    cost_ratio: float  # main cost / other cost (<1: main is cheaper)
    saving_usd: float  # other cost - main cost
    break_even_throughput: float | None  # other's throughput at which both cost the same


@dataclass(frozen=True)
class Report:
    """The answer: every estimate (the main type first), the comparisons with the main type,
    and notes on how the figures were reached (JSON field names are part of the interface)."""

    unit: str
    cache: str
    prices_as_of: str
    price_region: str
    work: dict[str, float | None]
    estimates: list[Estimate]
    comparisons: list[Comparison]
    notes: list[str]
    checkpoints: CheckpointPlan | None = None  # with --checkpoint-save-seconds


def resolve_spec(name: str) -> InstanceTypeSpec:
    """The hardware facts of an EC2 type, or of the EC2 type under a SageMaker ``ml.*`` one."""
    base = name.removeprefix(SAGEMAKER_PREFIX)
    if base not in INSTANCE_TYPES:
        known = ", ".join(INSTANCE_TYPES)
        raise EstimateError(
            f"unknown instance type {name!r}; known: {known} (optionally prefixed 'ml.')"
        )
    return INSTANCE_TYPES[base]


def resolve_price(name: str, overrides: dict[str, float]) -> tuple[float, bool]:
    """USD per node-hour, and whether it is an override rather than the table's price."""
    if name in overrides:
        return overrides[name], True
    if name.startswith(SAGEMAKER_PREFIX):
        raise EstimateError(
            f"no price for {name}: the table holds EC2 on-demand prices only; "
            f"give the SageMaker price with --price {name}=USD_PER_HOUR"
        )
    price = resolve_spec(name).on_demand_usd_per_hour
    if price is None:
        raise EstimateError(
            f"no on-demand price for {name} in the table; give one with --price {name}=USD_PER_HOUR"
        )
    return price, False


def estimate(
    cand: Candidate, work: Work, unit: str, *, cache: str, train_seconds: float
) -> Estimate:
    node_hour_usd = cand.usd_per_node_hour * cand.nodes
    warm_cost = node_hour_usd * train_seconds / 3600
    cold_cost = node_hour_usd * (train_seconds + cand.compile_seconds) / 3600
    compile_billed = cand.compile_seconds if cache == "cold" else 0.0
    total = train_seconds + compile_billed
    cost = cold_cost if cache == "cold" else warm_cost
    samples, tokens = work.samples, work.tokens
    source = "override" if cand.price_overridden else f"on-demand {PRICE_REGION} {PRICES_AS_OF}"
    return Estimate(
        instance_type=cand.instance_type,
        accelerator=cand.spec.accelerator,
        nodes=cand.nodes,
        usd_per_node_hour=cand.usd_per_node_hour,
        price_source=source,
        throughput=cand.throughput,
        throughput_unit=unit,
        train_seconds=train_seconds,
        compile_seconds=compile_billed,
        cache=cache,
        total_seconds=total,
        instance_hours=cand.nodes * total / 3600,
        cost_usd=cost,
        cost_warm_cache_usd=warm_cost,
        cost_cold_cache_usd=cold_cost,
        warm_cache_saving_usd=cold_cost - warm_cost,
        cost_per_million_samples_usd=cost / samples * 1e6 if samples else None,
        cost_per_million_tokens_usd=cost / tokens * 1e6 if tokens else None,
    )


def train_seconds_for(
    cand: Candidate, work: Work, unit: str, main: tuple[Candidate, float] | None
) -> float | None:
    """Training time (compile excluded): measured; scaled from the main run's measured time
    by the throughput ratio (its overheads scale alike); or work / throughput."""
    if cand.seconds is not None:
        return cand.seconds
    if cand.throughput is None:
        return None
    if main is not None and main[0].seconds is not None and main[0].throughput:
        return main[1] * main[0].throughput / cand.throughput
    if work.amount is None:
        return None
    amount = work.convert(work.amount, work.unit, _WORK_OF_UNIT[unit])
    if amount is None:
        raise EstimateError(
            f"cannot turn {work.unit} into {_WORK_OF_UNIT[unit]} for a throughput in {unit}: "
            "give --batch-size (samples per step) and/or --tokens-per-sample"
        )
    return amount / cand.throughput


def compare(main: Estimate, main_cand: Candidate, other: Estimate, ocand: Candidate) -> Comparison:
    speedup = None
    if main_cand.throughput and ocand.throughput:
        speedup = main_cand.throughput / ocand.throughput
    return Comparison(
        instance_type=other.instance_type,
        speedup=speedup,
        time_ratio=main.total_seconds / other.total_seconds,
        cost_ratio=main.cost_usd / other.cost_usd,
        saving_usd=other.cost_usd - main.cost_usd,
        break_even_throughput=break_even(main, main_cand, ocand),
    )


def break_even(main: Estimate, main_cand: Candidate, ocand: Candidate) -> float | None:
    """The other type's throughput at which it would cost as much as the main run."""
    if not main_cand.throughput:
        return None
    other_node_hour = ocand.usd_per_node_hour * ocand.nodes
    compile_billed = ocand.compile_seconds if main.cache == "cold" else 0.0
    seconds = main.cost_usd * 3600 / other_node_hour - compile_billed
    if seconds <= 0:
        return None  # its compile time alone costs more than the main run
    return main_cand.throughput * main.train_seconds / seconds
