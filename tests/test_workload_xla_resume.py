"""The same model and the same run on XLA as on the CPU, across a kill and a resume.

On torch-xla 2.9's CPU client (PJRT_DEVICE=CPU), the Trainium code path minus the Neuron
compiler:

- GPT-2's LM head stays its input embedding after the move to the XLA device
  (``Module._apply`` unties them; transformers' Trainer calls ``tie_weights()`` after moving a
  model to an XLA device for this reason): one parameter, as on the CPU;
- a causal LM with dropout on, killed after a save at an epoch's last step and resumed there,
  ends bit-identical to a run that never stopped (torch-xla advances the device seed at every
  ``torch_xla.sync()``, and the loader syncs once more there in the run that goes on);
- the resumed run traces no graph, by torch-xla's own HLO dump (``XLA_SAVE_TENSORS_FILE``),
  that the run that never stopped did not: nothing for precompile to miss.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_workload_xla_graphs import traced_graphs
from tests.workload_support import PYTHON, REPO, events, job_env, make_data, run_train, summary

pytestmark = [pytest.mark.xla]

#: On the XLA device and on the CPU: the parameters the optimizer trains, and whether the
#: LM head is the input embedding.
TIED = textwrap.dedent(
    """
    import copy, json, sys
    sys.path.insert(0, {repo!r})
    import torch
    from workload.backend import setup_backend
    from workload.checkpoint import model_state_cpu
    from workload.config import TrainConfig
    from workload.engine import build_optimizer
    from workload.model import build_model, train_tiny_tokenizer

    config = TrainConfig(data="unused", output="unused", task="causal-lm", tiny_hidden_size=16,
                         tiny_layers=1, tiny_heads=2, tiny_vocab_size=300, max_length=16)
    tokenizer = train_tiny_tokenizer(["a good item, it works"] * 20, "causal-lm", 300)
    torch.manual_seed(0)
    cpu = build_model(config, tokenizer, xla=True)
    xla = setup_backend("xla", "fp32").prepare_model(copy.deepcopy(cpu))

    def described(model):
        optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.01)
        return {{
            "parameters": len(list(model.parameters())),
            "elements": sum(p.numel() for p in model.parameters()),
            "trained": sum(len(g["params"]) for g in optimizer.param_groups),
            "head_is_embedding": model.lm_head.weight is model.transformer.wte.weight,
            "saved": sorted(model_state_cpu(model)),
            "device": str(model.lm_head.weight.device),
        }}

    print(json.dumps({{"cpu": described(cpu), "xla": described(xla)}}))
    """
)


def test_gpt2_on_xla_trains_one_embedding_matrix_as_on_the_cpu(tmp_path: Path) -> None:
    script = tmp_path / "tied.py"
    script.write_text(TIED.format(repo=str(REPO)))
    result = subprocess.run(
        [PYTHON, str(script)],
        capture_output=True, text=True, env=job_env(xla=True), timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    cpu, xla = found["cpu"], found["xla"]
    assert cpu["head_is_embedding"] and xla["head_is_embedding"]
    assert xla["device"].startswith("xla")
    for key in ("parameters", "elements", "trained", "saved"):
        assert xla[key] == cpu[key], key
    assert "lm_head.weight" not in xla["saved"]  # saved once, as the embedding


# -- the first step after a resume -------------------------------------------------------------

#: For BERT and GPT-2: steps, a checkpoint's model and optimizer state on the CPU, a new model
#: and optimizer loaded from it, and steps again; the HLO of each step from torch-xla's dump.
RESUMED_STEP = textwrap.dedent(
    """
    import copy, json, os, re, sys
    sys.path.insert(0, {repo!r})
    import torch, torch_xla.debug.metrics as met
    from workload.backend import setup_backend
    from workload.checkpoint import model_state_cpu, to_cpu
    from workload.config import TrainConfig
    from workload.engine import TrainStep, build_optimizer, build_scheduler
    from workload.model import build_model, train_tiny_tokenizer

    backend = setup_backend("xla", "fp32")
    dump = os.environ["XLA_SAVE_TENSORS_FILE"] + ".0"
    graph = re.compile(r"## BEGIN_GRAPH\\n(.*?)\\n\\nGraph Hash", re.S)

    def graphs():
        if not os.path.exists(dump):  # nothing executed yet
            return []
        with open(dump, encoding="utf-8") as handle:
            return graph.findall(handle.read())

    def trained(model, optimizer, scheduler, steps):
        step = TrainStep(model, optimizer, scheduler, backend)
        for _ in range(steps):
            step(batch)
            step.pop_mean_loss()  # a log line after every step

    found = {{}}
    for task in ("classification", "causal-lm"):
        config = TrainConfig(data="unused", output="unused", task=task, tiny_hidden_size=16,
                             tiny_layers=1, tiny_heads=2, tiny_vocab_size=300, max_length=16)
        tokenizer = train_tiny_tokenizer(["a good item, it works"] * 20, task, 300)
        torch.manual_seed(0)
        initial = build_model(config, tokenizer, xla=True)
        ids = torch.randint(5, 300, (4, 16))
        labels = ids if task == "causal-lm" else torch.tensor([0, 1, 0, 1])
        batch = {{"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long),
                  "labels": labels}}
        batch = {{k: v.to(backend.device) for k, v in batch.items()}}

        model = backend.prepare_model(copy.deepcopy(initial))
        optimizer = build_optimizer(model, 1e-3, 0.01)
        scheduler = build_scheduler(optimizer, 2, 100)
        first = len(graphs())
        trained(model, optimizer, scheduler, 4)  # the first step, then the steady state
        never_stopped = graphs()[first + 1:]
        saved = model_state_cpu(model), to_cpu(optimizer.state_dict()), scheduler.state_dict()
        del model, optimizer, scheduler

        fresh = copy.deepcopy(initial)
        fresh.load_state_dict(saved[0], strict=False)
        model = backend.prepare_model(fresh)
        optimizer = build_optimizer(model, 1e-3, 0.01)
        scheduler = build_scheduler(optimizer, 2, 100)
        optimizer.load_state_dict(saved[1])
        scheduler.load_state_dict(saved[2])
        before = len(graphs()), met.counter_value("UncachedCompile")
        trained(model, optimizer, scheduler, 2)
        found[task] = {{
            "steady": len(set(never_stopped)),
            "new": sum(g not in never_stopped for g in graphs()[before[0]:]),
            "compiles": met.counter_value("UncachedCompile") - before[1],
        }}
    print(json.dumps(found))
    """
)


def test_the_first_step_after_a_resume_traces_the_steady_state_graph(tmp_path: Path) -> None:
    script = tmp_path / "resumed_step.py"
    script.write_text(RESUMED_STEP.format(repo=str(REPO)))
    env = job_env(xla=True)
    env.update(XLA_SAVE_TENSORS_FILE=str(tmp_path / "steps.hlo"), XLA_SAVE_TENSORS_FMT="hlo")
    result = subprocess.run(
        [PYTHON, str(script)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for task in ("classification", "causal-lm"):
        assert found[task]["steady"] == 1, task  # one graph for every step after the first
        # Neither a graph torch-xla's hash tells apart (the compile counter) nor one only the
        # HLO does (a transpose traced once instead of twice): the compiler gets the same HLO.
        assert found[task] == {"steady": 1, "new": 0, "compiles": 0}, task


# -- kill and resume -----------------------------------------------------------------------------

#: train.py, SIGKILLed at the first step it starts once checkpoint ``step`` is complete. That
#: one save is waited for where it is submitted: written in the background, it could still be in
#: flight when the job's last step had started on a loaded machine (its steps take
#: milliseconds), and the job then ran to its end unkilled.
KILL_AFTER_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import workload.train as train
    from workload.checkpoint import list_checkpoints
    from workload.checkpoint_writer import CheckpointWriter

    submit = CheckpointWriter.submit

    def submit_and_finish(self, step, model, trainer_state):
        submit(self, step, model, trainer_state)
        if step == {step}:
            self.wait()

    class KilledAfterSave(train.TrainStep):
        def __call__(self, batch):
            if {step} in [step for step, _ in list_checkpoints(Path({output!r}))]:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__call__(batch)

    CheckpointWriter.submit = submit_and_finish
    train.TrainStep = KilledAfterSave
    sys.exit(train.main())
    """
)

STEPS = 12
EPOCH_END = 8  # 32 examples at batch 4: the save at step 8 is the first epoch's last step
#: A 1-layer GPT-2 with dropout on: 8 steps an epoch, a save every 4 steps (mid-epoch at 4 and
#: 12, at the epoch's end at 8), evaluation at each epoch's end, every step's loss logged.
CAUSAL_JOB = (
    *("--task", "causal-lm", "--model", "tiny", "--tiny-hidden-size", "32"),
    *("--tiny-layers", "1", "--tiny-heads", "2", "--tiny-vocab-size", "400"),
    *("--max-length", "32", "--batch-size", "4", "--dropout", "0.1", "--seed", "3"),
    *("--device", "xla", "--max-steps", str(STEPS), "--log-every", "1"),
    *("--checkpoint-every", "4", "--eval-every", "0", "--keep-checkpoints", "5"),
)


def _dumped_run(
    args: list[str], dump: Path, script: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = job_env(xla=True)
    env.update(XLA_SAVE_TENSORS_FILE=str(dump), XLA_SAVE_TENSORS_FMT="hlo")
    command = [PYTHON, str(script or REPO / "workload" / "train.py"), *args]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=600, check=False
    )


def _graphs(dump: Path) -> list[str]:
    (written,) = dump.parent.glob(f"{dump.name}*")  # torch-xla appends the device ordinal
    return traced_graphs(written)


def _weights(output: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(output / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


@pytest.mark.slow
def test_a_causal_lm_killed_after_an_epoch_end_save_resumes_bit_identical_and_compiles_nothing_new(
    tmp_path: Path,
) -> None:
    data = make_data(tmp_path / "data", train=32, test=8, seed=4)
    reference, job = tmp_path / "reference", tmp_path / "job"

    never_stopped = _dumped_run(
        ["--data", str(data), "--output", str(reference), *CAUSAL_JOB], tmp_path / "ref.hlo"
    )
    assert never_stopped.returncode == 0, never_stopped.stderr[-4000:]

    driver = tmp_path / "killed_after_save.py"
    driver.write_text(KILL_AFTER_SAVE.format(repo=str(REPO), step=EPOCH_END, output=str(job)))
    killed = run_train(
        ["--data", str(data), "--output", str(job), *CAUSAL_JOB], xla=True, script=driver
    )
    assert killed.returncode == -9, killed.stderr[-4000:]
    resumed = _dumped_run(
        ["--data", str(data), "--output", str(job), *CAUSAL_JOB], tmp_path / "resumed.hlo"
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["step"] for r in events(job, "resume")] == [EPOCH_END]

    # Dropout was on in the model both runs trained.
    config = json.loads((job / "checkpoints" / f"step_{STEPS:08d}" / "config.json").read_text())
    assert config["resid_pdrop"] == config["attn_pdrop"] == config["embd_pdrop"] == 0.1

    def losses(output: Path) -> dict[int, float]:
        return {line["step"]: line["loss"] for line in events(output, "train")}

    expected, found = losses(reference), losses(job)
    assert sorted(found) == list(range(1, STEPS + 1))
    assert [found[step] for step in found] == [expected[step] for step in found]
    final, wanted = _weights(job, STEPS), _weights(reference, STEPS)
    assert final.keys() == wanted.keys()
    assert "lm_head.weight" not in final  # tied: one matrix, saved as the embedding
    assert [name for name in final if not torch.equal(final[name], wanted[name])] == []
    assert summary(job)["final_eval_loss"] == summary(reference)["final_eval_loss"]

    # Every graph of the resumed leg is one the run that never stopped compiled too.
    never_stopped_graphs = set(_graphs(tmp_path / "ref.hlo"))
    new = [
        graph for graph in _graphs(tmp_path / "resumed.hlo") if graph not in never_stopped_graphs
    ]
    assert new == [], f"{len(new)} graph(s) of their own after the resume"
