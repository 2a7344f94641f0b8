"""The graphs the XLA step traces, on torch-xla's CPU client (PJRT_DEVICE=CPU).

On Trainium every new graph is a neuronx-cc compile of minutes while the other ranks wait,
and the shared compile cache only helps when every rank and every run traces the same
graphs. These tests pin that down with a tiny BERT (1 layer, hidden 32, 32 tokens):

- batches with and without padding trace the same graphs, and a training step reads
  nothing back from the device (transformers 5 would check ``padding_mask.all()``);
- the step graph does not change across optimizer step 36,314 (where non-capturable
  AdamW's ``bias_correction2 ** 0.5`` becomes exactly 1.0), nor across a resume there;
- the HLO of every graph is the same for two ranks and for two runs with different
  output directories and job ids.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.workload_support import PYTHON, REPO, events, job_env, run_train, summary

pytestmark = [pytest.mark.xla]

TINY = (
    *("--model", "tiny", "--tiny-hidden-size", "32", "--tiny-layers", "1", "--tiny-heads", "2"),
    *("--tiny-vocab-size", "500", "--max-length", "32", "--batch-size", "4", "--seed", "5"),
    *("--device", "xla", "--log-every", "3", "--eval-every", "6", "--checkpoint-every", "6"),
)
#: A few steps through every kind of graph: steps, evaluation, checkpoints; dropout on, so
#: the random state (seeded per rank) takes part.
GRAPH_JOB = (
    *("--max-length", "32", "--batch-size", "4", "--device", "xla", "--dropout", "0.1"),
    *("--max-steps", "4", "--log-every", "2", "--eval-every", "2", "--checkpoint-every", "2"),
)
GOOD = ("good", "great", "fine", "lovely", "solid")
BAD = ("bad", "poor", "awful", "broken", "weak")
FILLER = ("the", "item", "arrived", "today", "and", "it", "works", "as", "described", "here")


def _review(index: int, long: bool) -> dict[str, Any]:
    label = index % 2
    words = GOOD if label else BAD
    count = 48 if long else 4  # 48 words fill 32 tokens; 4 leave most of them padding
    content = " ".join(
        words[(index + i) % 5] if i % 3 == 0 else FILLER[(index + i) % 10] for i in range(count)
    )
    return {"label": label, "title": words[index % 5], "content": content}


def write_data(directory: Path, *, long_every: int) -> Path:
    """Reviews; every ``long_every``-th is long enough to fill the sequence (0: none)."""
    directory.mkdir(parents=True)
    for split, size in (("train", 64), ("test", 24)):
        rows = [_review(i, bool(long_every) and i % long_every != 0) for i in range(size)]
        with (directory / f"{split}.jsonl").open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    return directory


def batches_without_padding(output: Path, steps: int) -> int:
    """How many of the first ``steps`` training batches have no padding at all."""
    import numpy as np

    from workload.batches import TrainBatches

    (cache,) = (output / "token-cache").glob("train-*")
    lengths = np.load(cache / "lengths.npy")
    order = TrainBatches(len(lengths), 4, 0, 1, 5)
    full = 0
    for epoch in range(steps // order.steps_per_epoch + 1):
        order.set_position(epoch, 0)
        for batch in list(order)[: steps - epoch * order.steps_per_epoch]:
            full += int(all(lengths[i] == 32 for i in batch))
    return full


def train_twice(data: Path, output: Path) -> list[dict[str, Any]]:
    """12 steps, then a resume from the step-12 checkpoint to step 20; both summaries."""
    summaries = []
    for steps in (12, 20):
        result = run_train(
            ["--data", str(data), "--output", str(output), *TINY, "--max-steps", str(steps)],
            xla=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        summaries.append(summary(output))
    assert [r["step"] for r in events(output, "resume")] == [12]
    return summaries


@pytest.mark.slow
def test_batches_without_padding_compile_nothing_new_and_steps_read_nothing_back(
    tmp_path: Path,
) -> None:
    padded = train_twice(write_data(tmp_path / "short", long_every=0), tmp_path / "padded")
    mixed_output = tmp_path / "mixed"
    mixed = train_twice(write_data(tmp_path / "long", long_every=4), mixed_output)
    # The mixed data really mixes: some batches have no padding, others do.
    assert 0 < batches_without_padding(mixed_output, 20) < 20
    assert batches_without_padding(tmp_path / "padded", 20) == 0

    for fresh, resumed in (padded, mixed):
        assert resumed["resumed_from"].endswith("step_00000012")
        # Each leg seeds the Neuron runtime's stochastic rounding from --seed and its step.
        seeds = [r["environment"]["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] for r in (fresh, resumed)]
        assert seeds == [str(5 * 1_000_003), str(5 * 1_000_003 + 12)]
        for run in (fresh, resumed):
            assert run["graphs_per_step"] == 1
            assert run["xla_compiles_after_warmup"] == 0
            assert run["xla_host_transfers_per_step"] == 0  # the log line's read is outside
            assert run["xla_graphs_per_step"] == 1  # graphs launched per step after warm-up
    assert [r["xla_compiles"] for r in mixed] == [r["xla_compiles"] for r in padded]
    for line in events(mixed_output, "train") + events(mixed_output, "eval"):
        if "xla_compiles_after_warmup" in line:
            assert line["xla_compiles_after_warmup"] == 0


# -- optimizer step 36,314 ---------------------------------------------------------------------

STEP_36314 = """
import json, sys
sys.path.insert(0, {repo!r})
import torch, torch_xla, torch_xla.debug.metrics as met
from workload.backend import setup_backend
from workload.engine import build_optimizer

capturable = {capturable!r}
backend = setup_backend("xla", "fp32")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(backend.device)
if capturable:
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.01)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
x = torch.randn(4, 8).to(backend.device)

def step():
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()

def jump_to(count):  # as a resume from a checkpoint written at optimizer step ``count``
    state = optimizer.state_dict()
    for entry in state["state"].values():
        entry["step"] = torch.tensor(float(count))
    optimizer.load_state_dict(state)

for _ in range(3):  # the first step creates the state: a graph of its own
    step()
jump_to(36310)
step()  # the first step after a load
warm = met.counter_value("UncachedCompile")
for _ in range(5):  # optimizer steps 36,312 to 36,316
    step()
crossing = met.counter_value("UncachedCompile") - warm
jump_to(36313)  # a resume just before the step: nothing new from here on
warm = met.counter_value("UncachedCompile")
for _ in range(3):
    step()
print(json.dumps({{"crossing": crossing, "resume": met.counter_value("UncachedCompile") - warm}}))
"""


def _compiles_across_36314(tmp_path: Path, capturable: bool) -> dict[str, int]:
    script = tmp_path / f"step_36314_{capturable}.py"
    script.write_text(STEP_36314.format(repo=str(REPO), capturable=capturable))
    result = subprocess.run(
        [PYTHON, str(script)],
        capture_output=True,
        text=True,
        env=job_env(xla=True),
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_step_graph_does_not_change_across_optimizer_step_36314(tmp_path: Path) -> None:
    assert _compiles_across_36314(tmp_path, capturable=True) == {"crossing": 0, "resume": 0}


def test_plain_foreach_adamw_recompiles_at_step_36314(tmp_path: Path) -> None:
    # The platform rule the optimizer choice rests on (NOTES.md): without it, new graphs.
    found = _compiles_across_36314(tmp_path, capturable=False)
    assert found["crossing"] > 0


# -- the same graphs on every rank and in every run ----------------------------------------------

#: train.py as rank ``RANK`` of 2 (torch-xla's CPU client runs one process, so the rank is
#: set on the backend: seeds, data shard, who saves and who logs all follow it; the
#: gradient all-reduce is a no-op on one device, the loss all-reduce runs on one replica).
AS_RANK = """
import os, sys
sys.path.insert(0, {repo!r})
import workload.backend as backend_module
import workload.train as train

real = backend_module._setup_xla

def as_rank(*args, **kwargs):
    backend = real(*args, **kwargs)
    backend.rank = int(os.environ["FAKE_RANK"])
    backend.world_size = 2
    backend.local_rank = 0  # the first process of its node
    backend.all_gather_object = lambda obj: [obj, obj]  # the other rank says the same
    return backend

backend_module._setup_xla = as_rank
# One process stands for the rank: what rank 0 reads or makes once and broadcasts (the data
# directory, the tokenizer, the token cache, a resumed state), it reads itself. The sharing
# itself is tested with real ranks (tests/test_start_limits.py).
train.read_once = lambda backend, read: read()
train.main_then_nodes = lambda backend, make, reuse, follower: make()
sys.exit(train.main())
"""

GRAPH = re.compile(r"## BEGIN_GRAPH\n(.*?)\n## END_GRAPH", re.S)


def traced_graphs(dump: Path) -> list[str]:
    """The distinct HLO modules in a torch-xla graph dump, in order of first appearance."""
    seen: dict[str, None] = {}
    for graph in GRAPH.findall(dump.read_text(encoding="utf-8")):
        seen.setdefault(graph.strip(), None)
    return list(seen)


@pytest.mark.slow
def test_every_rank_and_every_run_traces_the_same_hlo(tmp_path: Path) -> None:
    import torch

    from tests.workload_support import make_data, no_xla_side_effects
    from workload.config import TrainConfig
    from workload.data import find_split_files, read_split
    from workload.model import build_model, train_tiny_tokenizer

    data = make_data(tmp_path / "data", train=32, test=12, seed=2)
    model = tmp_path / "initial"  # one model directory, as a hub name would give every rank
    config = TrainConfig(
        data=str(data), output="unused", tiny_hidden_size=32, tiny_layers=1, tiny_heads=2,
        tiny_vocab_size=500, max_length=32,
    )  # fmt: skip
    with no_xla_side_effects():
        raw = read_split(find_split_files(data, "train"), "classification")
        tokenizer = train_tiny_tokenizer(raw.texts(), "classification", 500)
        torch.manual_seed(0)
        build_model(config, tokenizer, xla=True).save_pretrained(model)
        tokenizer.save_pretrained(model)

    driver = tmp_path / "as_rank.py"
    driver.write_text(AS_RANK.format(repo=str(REPO)))
    dumps = {}
    # Rank 1 also runs with another output directory and job id: the same HLO shows that
    # neither the rank nor anything of the run enters a graph.
    for rank, job in ((0, "job-a"), (1, "job-b")):
        dump = tmp_path / f"rank{rank}.hlo"
        env = job_env(xla=True)
        env.update(
            FAKE_RANK=str(rank),
            TRAINIUM_JOB_ID=job,
            XLA_SAVE_TENSORS_FILE=str(dump),
            XLA_SAVE_TENSORS_FMT="hlo",
        )
        output = tmp_path / job / "output"
        result = subprocess.run(
            [PYTHON, str(driver), "--data", str(data), "--model", str(model),
             "--output", str(output), *GRAPH_JOB],
            capture_output=True, text=True, env=env, timeout=600, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        (written,) = tmp_path.glob(f"rank{rank}.hlo*")  # torch-xla appends the device ordinal
        dumps[rank] = traced_graphs(written)

    assert len(dumps[0]) >= 3  # the first step, the step, evaluation (at least)
    assert dumps[1] == dumps[0]


# -- the measurement of one against two graphs per step --------------------------------------


def test_step_graphs_measures_both_variants(tmp_path: Path) -> None:
    result = subprocess.run(
        [PYTHON, str(REPO / "workload" / "step_graphs.py"), "--hidden", "16", "--layers", "1",
         "--seq", "16", "--batch", "2", "--rounds", "2", "--block", "2"],
        capture_output=True, text=True, env=job_env(xla=True), timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["device"] == "xla:CPU"
    assert found["compiles_after_warmup"] == 0
    for graphs in (1, 2):
        variant = found[f"graphs_per_step={graphs}"]
        assert variant["launched_per_step"] == graphs
        assert variant["host_transfers_per_step"] == 0
        assert 0 < variant["p10_ms"] <= variant["median_ms"] <= variant["p90_ms"]


def test_step_graphs_refuses_bad_sizes_in_one_line() -> None:
    result = subprocess.run(
        [PYTHON, str(REPO / "workload" / "step_graphs.py"), "--hidden", "30"],
        capture_output=True, text=True, env=job_env(xla=True), timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "step_graphs.py: error: --hidden 30 must be a multiple of 4 (4 attention heads) "
        "(--help lists the flags)"
    ]


# -- the smaller items: broadcast, the logged loss, the checkpoint transfer ------------------

#: In one process, on the XLA device: what the trainer does at start (broadcast), in every
#: step (the loss reduced over ranks on the device) and at a save (one transfer). The rank
#: and the world are set on the backend and on torch-xla's runtime, as AS_RANK does.
SMALL_ITEMS = """
import json, sys
sys.path.insert(0, {repo!r})
import torch, torch_xla, torch_xla.runtime as xr
from workload.backend import setup_backend
from workload.checkpoint import to_cpu
from workload.engine import TrainStep, build_optimizer

backend = setup_backend("xla", "fp32")
backend.world_size = 2
found = {{}}

def parameters(model):
    return [p.detach().cpu().clone() for p in model.parameters()]

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(backend.device)

# Rank 0 keeps its parameters; any other rank contributes nothing to the broadcast's sum, so
# on this one-replica client it is left with zeros where rank 0's values would arrive.
real_ordinal = xr.global_ordinal
for rank in (0, 1):
    xr.global_ordinal = lambda rank=rank: rank
    model = net()
    initial = parameters(model)
    backend.broadcast_parameters(model)
    after = parameters(model)
    found[f"rank{{rank}}_unchanged"] = all(torch.equal(a, b) for a, b in zip(initial, after))
    found[f"rank{{rank}}_zero"] = all(not a.any() for a in after)
xr.global_ordinal = real_ordinal

# The logged loss: reduced over ranks inside the step, on the device; read once per log line.
class Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = net()
    def forward(self, input_ids, labels):
        loss = torch.nn.functional.cross_entropy(self.body(input_ids), labels)
        return type("Out", (), {{"loss": loss}})

model = Loss()
optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.0)
reduced_on = []
real_reduce = backend.all_reduce_sum
backend.all_reduce_sum = lambda t: (reduced_on.append(t.device.type), real_reduce(t))[1]
step = TrainStep(model, optimizer, None, backend)
batch = {{"input_ids": torch.randn(4, 8).to(backend.device),
         "labels": torch.tensor([0, 1, 0, 1]).to(backend.device)}}
step(batch)  # warm-up: the first step creates the AdamW state
step.pop_mean_loss()
reduced_on.clear()
before = backend.host_transfers()
for _ in range(3):
    step(batch)
found["step_transfers"] = backend.host_transfers() - before
found["reduced_in_steps"] = list(reduced_on)
before = backend.host_transfers()
found["mean_loss"] = step.pop_mean_loss()
found["log_transfers"] = backend.host_transfers() - before
found["reduced_after_log"] = reduced_on[len(found["reduced_in_steps"]):]

# A save fetches every XLA tensor of the model and optimizer state in one transfer.
state = {{"model": model.state_dict(), "optimizer": optimizer.state_dict()}}
found["tensors"] = len(model.state_dict()) + sum(
    1 for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)
)
before = backend.host_transfers()
cpu = to_cpu(state)
found["save_transfers"] = backend.host_transfers() - before
found["on_cpu"] = all(v.device.type == "cpu" for v in cpu["model"].values())
print(json.dumps(found))
"""


def test_broadcast_logged_loss_and_checkpoint_transfer_on_xla(tmp_path: Path) -> None:
    script = tmp_path / "small_items.py"
    script.write_text(SMALL_ITEMS.format(repo=str(REPO)))
    result = subprocess.run(
        [PYTHON, str(script)],
        capture_output=True, text=True, env=job_env(xla=True), timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # Rank 0's parameters are what every rank holds after the broadcast at start.
    assert found["rank0_unchanged"] and not found["rank0_zero"]
    assert found["rank1_zero"] and not found["rank1_unchanged"]
    # The loss is all-reduced in each step's graph and read once, at the log line.
    assert found["reduced_in_steps"] == ["xla"] * 3
    assert found["step_transfers"] == 0
    assert found["reduced_after_log"] == []
    assert found["log_transfers"] == 1
    assert found["mean_loss"] > 0
    # 4 parameters + 8 AdamW tensors (+ step counts) in one device-to-host transfer.
    assert found["tensors"] >= 12
    assert found["save_transfers"] == 1
    assert found["on_cpu"]
