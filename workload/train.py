"""Train: ``torchrun --nproc_per_node=N workload/train.py --data DIR --output DIR [...]``.

Reads top to bottom: config, distributed setup, data (validate, tokenizer, token cache),
model, resume, the training loop with periodic evaluation and checkpoints, the summary.
``python workload/train.py --help`` lists the flags. Bad flags and missing or bad data (the
job's own input) exit with status 2, which the cluster does not retry; a bad model or
checkpoint with status 1; both print one ``train.py: error: ...`` line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Started as a script (torchrun workload/train.py, from any directory): make the
    # package that holds this file importable as ``workload``.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from workload.backend import (
    Backend,
    BackendError,
    graphs_only,
    neuron_environment,
    resolve_device_kind,
    setup_backend,
)
from workload.batches import EvalBatches, TrainBatches, make_loader
from workload.checkpoint import (
    FORMAT_VERSION,
    latest_checkpoint,
    load_model_weights,
    load_trainer_state,
    remove_partial,
    to_cpu,
)
from workload.checkpoint_writer import CheckpointWriter
from workload.config import ConfigError, TrainConfig, parse_config
from workload.data import (
    SPLITS,
    find_split_files,
    forget_reads,
    read_split,
    read_splits,
    resolve_data_dir,
)
from workload.engine import (
    EvalResult,
    TrainStep,
    build_optimizer,
    build_scheduler,
    evaluate,
    flops_per_sample,
    mfu,
    peak_flops_per_device,
)
from workload.metrics import MetricsLogger
from workload.model import (
    build_model,
    load_tokenizer,
    save_tokenizer,
    train_tiny_tokenizer,
)
from workload.stop import (
    HOLD_POLL_SECONDS,
    HOLD_VARIABLE,
    StopAgreement,
    StopRequest,
    hold_after_step,
)
from workload.token_cache import (
    TokenizedSplit,
    cache_key,
    choose_cache_root,
    split_cache_dir,
    write_token_cache,
)
from workload.turns import (
    USER_ERRORS,
    SharedError,
    exit_status,
    leader_first,
    main_then_nodes,
    read_once,
)

log = logging.getLogger("workload.train")

#: Training steps after which, together with one finished evaluation, every graph of the
#: run has been traced and compiled (the first optimizer step creates the AdamW state).
WARMUP_STEPS = 3


def stochastic_rounding_seed(config: TrainConfig) -> str:
    """The Neuron runtime's stochastic-rounding seed for this process: from ``--seed`` and
    the step the job resumes from. The runtime seeds it from NEURON_RT_STOCHASTIC_ROUNDING_SEED
    (0 when unset) when it starts and exposes no state to save, so a resumed leg cannot
    continue the uninterrupted run's stream; with this seed each leg is reproducible (the
    same checkpoint and seed give the same rounding) and legs do not repeat one stream."""
    latest = latest_checkpoint(Path(config.output).expanduser())
    step = int(latest.name.removeprefix("step_")) if latest is not None else 0
    return str((config.seed * 1_000_003 + step) % 2**31)


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,
    )


class Run:
    """The state of one training process between setup and summary."""

    def __init__(self, config: TrainConfig, backend: Backend, started: float) -> None:
        self.config = config
        self.backend = backend
        self.started = started
        self.output = Path(config.output).expanduser().resolve()
        self.graphs_only = graphs_only()
        self.stop = StopRequest()
        self.agreement = StopAgreement(backend.start_any_rank)
        self.stopped_by_signal = False
        self.hold_after_step = hold_after_step(os.environ)

    # -- setup ---------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Validate the data, get the tokenizer, fill the token cache, open the splits."""
        config, backend = self.config, self.backend
        # Rank 0 first, then each node's leader checks that it sees the same directory (a
        # hub data set lands on the shared output once, not once per node).
        data_dir = main_then_nodes(
            backend,
            lambda: resolve_data_dir(config.data, self.output / "hub", allow_download=True),
            lambda first: first if first.is_dir() else None,
            lambda leaders: leaders,
        )
        # The tokenizer is made or loaded by rank 0 alone and reaches the other ranks as an
        # object, so no other rank opens its files (stacks/start_limits.py: TOKENIZER).
        if config.is_tiny:
            tokenizer_dir = self.output / "tokenizer"

            def make_tokenizer() -> Any:
                if not tokenizer_dir.is_dir():
                    raw = read_splits(data_dir, config.task)  # validates both splits first
                    trained = train_tiny_tokenizer(
                        raw["train"].texts(), config.task, config.tiny_vocab_size
                    )
                    save_tokenizer(trained, tokenizer_dir)
                return load_tokenizer(str(tokenizer_dir), config.task, allow_download=False)

            self.tokenizer = read_once(backend, make_tokenizer)
        else:
            self.tokenizer = read_once(
                backend, lambda: load_tokenizer(config.model, config.task, allow_download=True)
            )

        def fill_cache() -> dict[str, str]:
            # A trained tokenizer belongs to this job, and so does its cache.
            cache_dir = config.cache_dir or (
                str(self.output / "token-cache") if config.is_tiny else ""
            )
            root = choose_cache_root(data_dir, cache_dir, self.output)
            targets, missing = {}, {}
            for split in SPLITS:
                files = find_split_files(data_dir, split)
                key = cache_key(files, self.tokenizer, config.task, config.max_length)
                targets[split] = split_cache_dir(root, split, key)
                if not targets[split].is_dir():
                    missing[split] = files
            raw = {split: read_split(files, config.task) for split, files in missing.items()}
            for split, text in raw.items():  # all validated before anything is written
                write_token_cache(
                    text, self.tokenizer, config.task, config.max_length, targets[split]
                )
            forget_reads()
            return {split: str(path) for split, path in targets.items()}

        # Rank 0 fills the cache; another node's leader fills one only where it cannot see
        # rank 0's (a node-local --cache-dir), so on the shared file system the data is
        # tokenized and written once, not once per node (stacks/start_limits.py).
        paths = main_then_nodes(
            backend,
            fill_cache,
            lambda first: first if all(Path(p).is_dir() for p in first.values()) else None,
            lambda leaders: leaders,
        )
        self.train_split = TokenizedSplit(Path(paths["train"]), config.task)
        self.test_split = TokenizedSplit(Path(paths["test"]), config.task)
        log.info(
            "data: %d training and %d test examples from %s",
            len(self.train_split),
            len(self.test_split),
            data_dir,
        )

    def build(self) -> None:
        """Model, optimizer, schedule, batches, and the resume point if there is one."""
        config, backend = self.config, self.backend
        resume = backend.broadcast_object(
            str(latest_checkpoint(self.output) or "") if backend.is_main else None
        )
        self.resumed_from = Path(resume) if resume else None
        if self.resumed_from is None:
            log.info("starting fresh at step 0: no checkpoint in %s", self.output)

        backend.seed(config.seed)  # the same initial weights on every rank
        model = leader_first(
            backend,
            lambda: build_model(config, self.tokenizer, xla=backend.kind == "xla"),
            lambda: build_model(
                config, self.tokenizer, xla=backend.kind == "xla", allow_download=False
            ),
            per_node=True,
        )
        if self.resumed_from is not None:
            # Rank 0 alone reads the weights: broadcast_parameters below (and DDP when it
            # wraps the model) gives every rank rank 0's parameters and buffers.
            path = self.resumed_from
            leader_first(
                backend, lambda: load_model_weights(path, model), lambda: None, per_node=False
            )
        self.flops_per_sample = flops_per_sample(model, config.max_length)
        self.parameters = sum(p.numel() for p in model.parameters())
        self.model = backend.prepare_model(model)
        self.bare = backend.unwrap(self.model)
        backend.broadcast_parameters(self.bare)

        self.train_batches = TrainBatches(
            len(self.train_split), config.batch_size, backend.rank, backend.world_size, config.seed
        )
        self.eval_batches = EvalBatches(
            len(self.test_split), config.batch_size, backend.rank, backend.world_size
        )
        self.steps_per_epoch = self.train_batches.steps_per_epoch
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        warmup = int(self.total_steps * config.warmup_ratio)
        self.optimizer = build_optimizer(self.model, config.peak_lr, config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, warmup, self.total_steps)
        self.per_step = config.batch_size * backend.world_size

        self.step = 0
        self.epoch = 0
        self.offset = 0  # batches of the current epoch already trained
        if self.resumed_from is not None:
            self._restore(self.resumed_from)
        else:
            backend.seed(config.seed + 1000 * backend.rank)  # dropout differs across ranks

        pin = backend.kind == "cuda"
        self.train_loader = make_loader(
            self.train_split,
            self.train_batches,
            num_workers=config.num_workers,
            pin_memory=pin,
            seed=config.seed,
        )
        self.eval_loader = make_loader(
            self.test_split,
            self.eval_batches,
            num_workers=config.num_workers,
            pin_memory=pin,
            seed=config.seed,
        )
        self.train_step = TrainStep(
            self.model,
            self.optimizer,
            self.scheduler,
            backend,
            max_grad_norm=config.max_grad_norm,
            compile=config.compile_model,
            graphs_per_step=config.graphs_per_step,
        )

    def _restore(self, path: Path) -> None:
        config, backend = self.config, self.backend
        # Rank 0 reads the trainer state once and it reaches every rank through a tree of
        # broadcasts, each rank's RNG state to that rank alone (stacks/start_limits.py:
        # every rank reading it would read it once per node from the shared file system).
        rngs: list[Any] = []

        def read_state() -> dict[str, Any]:
            full = load_trainer_state(path)
            rngs.extend(full.pop("rng"))
            full["rng_count"] = len(rngs)
            return full

        state = read_once(backend, read_state)
        rng_count = int(state.pop("rng_count"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The restored optimizer and schedule go on as the job began them: a new --lr does not
        # apply to a resumed job (a new job ID starts a new schedule). Said, not silently kept.
        restored = self.optimizer.param_groups[0].get("initial_lr", config.lr)
        if restored != config.lr:
            log.warning(
                "--lr %g is not applied: the job resumes with its restored optimizer and "
                "learning-rate schedule (started at lr %g); start a new job to change it",
                config.lr,
                restored,
            )
        self.step = int(state["step"])
        if state["world_size"] == backend.world_size and state["batch_size"] == config.batch_size:
            self.epoch, self.offset = int(state["epoch"]), int(state["batch_in_epoch"])
        else:
            log.warning(
                "%s was written by %d processes with batch size %d; continuing with %d x %d "
                "from the same number of samples (the data order changes)",
                path,
                state["world_size"],
                state["batch_size"],
                backend.world_size,
                config.batch_size,
            )
            self.epoch, self.offset = divmod(
                int(state["samples_seen"]) // self.per_step, self.steps_per_epoch
            )
        if rng_count == backend.world_size:
            backend.set_rng_state(backend.scatter_object(rngs if backend.is_main else None))
        else:
            backend.seed(config.seed + 1000 * backend.rank + self.step)
        log.info("resuming from %s at step %d (epoch %d)", path, self.step, self.epoch)

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        config, backend = self.config, self.backend
        self.metrics = MetricsLogger(
            self.output,
            enabled=backend.is_main,
            total_steps=self.total_steps,
            initial_step=self.step,
        )
        if self.resumed_from is not None:
            self.metrics.write("resume", step=self.step, checkpoint=str(self.resumed_from))
        self.writer = CheckpointWriter(self.output, self.tokenizer, keep=config.keep_checkpoints)
        self.steps_this_run = 0
        self.evals_this_run = 0
        self.warm_compiles: int | None = None
        # Steps after warm-up, and the host transfers and graph executions inside them.
        self.warm_steps = self.warm_transfers = self.warm_executions = 0
        self.last_eval: EvalResult | None = None
        self.last_eval_step = -1
        self.last_save_step = self.step if self.resumed_from is not None else -1
        self.intervals: list[tuple[float, float, bool]] = []  # (samples, seconds, after warm-up)
        self.metrics.phase(self.step, "compiling")  # the run's first steps compile on XLA
        self._mark()

        try:
            while self.step < self.total_steps and not self.stopped_by_signal:
                self.train_batches.set_position(self.epoch, self.offset)
                for batch in backend.device_loader(self.train_loader):
                    before = (backend.host_transfers(), backend.executions())
                    backend.seed_step(config.seed, self.step)  # dropout: the same after a resume
                    self.train_step(batch)
                    self.writer.check()  # a save that failed in the background fails the job
                    if self.warm_compiles is not None and before[0] is not None:
                        self.warm_steps += 1
                        self.warm_transfers += (backend.host_transfers() or 0) - before[0]
                        self.warm_executions += (backend.executions() or 0) - (before[1] or 0)
                    self.step += 1
                    self.offset += 1
                    self.steps_this_run += 1
                    self.metrics.advance(self.step)
                    self._check_warm()
                    if self.step % config.log_every == 0 or self.step == self.total_steps:
                        self._log_train()
                    if config.eval_every and self.step % config.eval_every == 0:
                        self._evaluate()
                    if self.offset == self.steps_per_epoch:
                        self.epoch += 1
                        self.offset = 0
                        if not config.eval_every:
                            self._evaluate()
                    if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                        self._save()
                    if self.step == self.hold_after_step:
                        self._hold()
                    if self.step % config.log_every == 0 and self._stop_agreed():
                        self.stopped_by_signal = True
                        break
                    if self.step >= self.total_steps:
                        break
            self.agreement.finish()  # the vote in flight when the last step ended
            if self.stopped_by_signal:
                self.metrics.write("stop", step=self.step, reason="SIGTERM")
                log.info("SIGTERM: stopping after step %d with a checkpoint", self.step)
            elif self.last_eval_step != self.step:
                self._evaluate()
            if self.last_save_step != self.step:
                self._save()
            self.writer.wait()  # a stop or the end waits for the save in flight
            backend.barrier()
            return self._summary()
        finally:
            self.writer.close()
            self.metrics.close()

    def _stop_agreed(self) -> bool:
        """Whether the ranks agreed to stop after this log step because one of them received
        SIGTERM: the answer of the vote started at the previous log step, which ran beside
        the steps in between (workload/stop.py, ``StopAgreement``). Every rank stops after
        the same step; a signal is acted on within two ``--log-every`` intervals."""
        return self.agreement.at_log_step(self.stop.requested)

    def _hold(self) -> None:
        """Wait after this step until a stop is requested on any rank (workload/stop.py)."""
        self.writer.wait()  # held after a checkpoint step: that checkpoint is on disk
        self.metrics.write("hold", step=self.step)
        log.info("holding after step %d until a stop is requested (%s)", self.step, HOLD_VARIABLE)
        while not self.backend.any_rank(self.stop.requested):
            time.sleep(HOLD_POLL_SECONDS)
        self.agreement.agreed_elsewhere()

    def _mark(self) -> None:
        self.mark_time = time.perf_counter()
        self.mark_step = self.step

    def _check_warm(self) -> None:
        if (
            self.warm_compiles is None
            and self.evals_this_run > 0
            and self.steps_this_run >= WARMUP_STEPS
        ):
            self.warm_compiles = self.backend.compile_count()

    def _compile_fields(self) -> dict[str, Any]:
        count = self.backend.compile_count()
        if count is None:
            return {}
        fields: dict[str, Any] = {"xla_compiles": count}
        if self.warm_compiles is not None:
            fields["xla_compiles_after_warmup"] = count - self.warm_compiles
        if self.warm_steps:
            # Inside the steps only: the log line's loss read is outside.
            fields["xla_host_transfers_per_step"] = round(self.warm_transfers / self.warm_steps, 4)
            fields["xla_graphs_per_step"] = round(self.warm_executions / self.warm_steps, 4)
        return fields

    def _log_train(self) -> None:
        loss = self.train_step.pop_mean_loss()  # waits for the device: timing is honest
        now = time.perf_counter()
        seconds = max(now - self.mark_time, 1e-9)
        samples = (self.step - self.mark_step) * self.per_step
        self.intervals.append((samples, seconds, self.warm_compiles is not None))
        rate = samples / seconds
        fields = {
            "step": self.step,
            "epoch": round(self.step / self.steps_per_epoch, 4),
            "loss": None if self.graphs_only else loss,
            "lr": self.train_step.last_lr,
            "samples_per_second": round(rate, 3),
            "tokens_per_second": round(rate * self.config.max_length, 1),
            "elapsed_s": round(time.time() - self.started, 3),
            **self._compile_fields(),
        }
        self.metrics.write("train", **fields)
        self.metrics.progress(
            self.step,
            f"step {self.step}/{self.total_steps} loss {loss:.4f} "
            f"lr {self.train_step.last_lr:.2e} {rate:.1f} samples/s",
        )
        self._mark()

    def _evaluate(self) -> None:
        # A run's first evaluation compiles its graphs on XLA.
        self.metrics.phase(self.step, "evaluating" if self.evals_this_run else "compiling")
        began = time.perf_counter()
        result = evaluate(
            self.bare, self.backend.device_loader(self.eval_loader), self.backend, self.config.task
        )
        self.evals_this_run += 1
        self.last_eval, self.last_eval_step = result, self.step
        self._check_warm()
        fields = {
            "step": self.step,
            "eval_loss": None if self.graphs_only else result.loss,
            "eval_accuracy": None if self.graphs_only else result.accuracy,
            "eval_count": result.count,
            "eval_seconds": round(time.perf_counter() - began, 3),
            **self._compile_fields(),
        }
        self.metrics.write("eval", **fields)
        self.metrics.progress(
            self.step,
            f"eval at step {self.step}: loss {result.loss:.4f} accuracy {result.accuracy:.4f} "
            f"over {result.count}",
            keep=True,
        )
        self._mark()

    def _save(self) -> None:
        self.last_save_step = self.step
        if self.graphs_only:  # values are not computed under neuron_parallel_compile
            return
        self.metrics.phase(self.step, "saving")
        # Only rank 0 writes the RNG states: gathered to it alone (an all-gather would give
        # every rank all 32,768 at 1,024 nodes: stacks/start_limits.py RNG_GATHER).
        rng = self.backend.gather_object(self.backend.rng_state())
        if self.backend.is_main:
            state = {
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.offset,
                "samples_seen": self.step * self.per_step,
                "world_size": self.backend.world_size,
                "batch_size": self.config.batch_size,
                "optimizer": to_cpu(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng,
                "config": self.config.to_dict(),
                "eval_accuracy": self.last_eval.accuracy if self.last_eval else None,
                "device": self.backend.description,
                "torch_version": str(torch.__version__),
            }
            # Copied to host memory here, written while training goes on: the other ranks
            # do not wait for the write (workload/checkpoint_writer.py).
            self.writer.submit(self.step, self.bare, state)
        self._mark()

    def _summary(self) -> dict[str, Any]:
        config, backend = self.config, self.backend
        warm = [(s, t) for s, t, after in self.intervals if after] or [
            (s, t) for s, t, _ in self.intervals
        ]
        seconds = sum(t for _, t in warm)
        rate = sum(s for s, _ in warm) / seconds if seconds > 0 else 0.0
        peak = peak_flops_per_device(backend, config.peak_tflops or None)
        utilization = mfu(rate, self.flops_per_sample, backend.world_size, peak)
        result = self.last_eval
        summary = {
            "step": self.step,
            "epochs": round(self.step / self.steps_per_epoch, 4),
            "final_eval_accuracy": None if self.graphs_only or not result else result.accuracy,
            "final_eval_loss": None if self.graphs_only or not result else result.loss,
            "eval_count": result.count if result else 0,
            "total_time_s": round(time.time() - self.started, 3),
            "train_time_s": round(sum(t for _, t, _ in self.intervals), 3),
            "mean_samples_per_second": round(rate, 3),
            "mean_tokens_per_second": round(rate * config.max_length, 1),
            "flops_per_sample": self.flops_per_sample,
            "peak_tflops_per_device": peak / 1e12 if peak else None,
            "mfu": round(utilization, 5) if utilization is not None else None,
            "parameters": self.parameters,
            "device": backend.description,
            "world_size": backend.world_size,
            "precision": backend.precision,
            "batch_size": config.batch_size,
            "graphs_per_step": config.graphs_per_step if backend.kind == "xla" else None,
            "max_length": config.max_length,
            "model": config.model,
            "task": config.task,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "graphs_only": self.graphs_only,
            "stopped_by_signal": self.stopped_by_signal,
            **self._compile_fields(),
        }
        if backend.kind == "xla":
            summary["environment"] = neuron_environment()
        self.metrics.write("summary", **summary)
        if backend.kind == "xla" and summary.get("xla_compiles_after_warmup"):
            log.warning(
                "%d graph compilations after warm-up: some shape or constant changes between steps",
                summary["xla_compiles_after_warmup"],
            )
        log.info("summary: %s", json.dumps(summary))
        return summary


def train(config: TrainConfig, backend: Backend, started: float | None = None) -> dict[str, Any]:
    """Run one job to the end (resuming if the output holds a checkpoint); the summary."""
    run = Run(config, backend, started if started is not None else time.time())
    run.output.mkdir(parents=True, exist_ok=True)
    if backend.is_main:
        remove_partial(run.output)
        log.info("config: %s", json.dumps(config.to_dict()))
        log.info(
            "device %s, %d process(es), precision %s",
            backend.description,
            backend.world_size,
            backend.precision,
        )
        if backend.kind == "xla":
            log.info("Neuron/XLA environment in force: %s", neuron_environment() or "none set")
    with run.stop:  # from here on, SIGTERM ends the job at a step boundary, saved
        try:
            run.prepare_data()
            run.build()
            return run.train()
        except SharedError as exc:
            # Every rank raises it at once (after a collective), so it is printed once, by
            # rank 0, and here: when another rank exits with it first, torchrun's SIGTERM to
            # rank 0 only sets run.stop's flag, and rank 0 still prints it.
            if backend.is_main:
                _print_error(exc)
            raise


def _print_error(exc: BaseException) -> None:
    print(f"train.py: error: {exc}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line entry point; returns the exit status."""
    started = time.time()
    rank = int(os.environ.get("RANK", "0") or 0)
    setup_logging(rank)
    try:
        config = parse_config(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as exc:
        # Printed by every rank that finds it (the same line 32 times on a node when the
        # command line is wrong): torchrun SIGTERMs a node's other workers as soon as one
        # exits, before the trainer handles SIGTERM, so rank 0 alone would die unheard
        # whenever another rank got there first; and an error of one node's environment
        # (no CUDA device, NEURON_CC_FLAGS) is found on that node's ranks only.
        _print_error(exc)
        return 2
    try:
        if resolve_device_kind(config.device) == "xla":
            # Read by the Neuron runtime when the XLA device starts (in setup_backend); an
            # operator's own value wins.
            os.environ.setdefault(
                "NEURON_RT_STOCHASTIC_ROUNDING_SEED", stochastic_rounding_seed(config)
            )
        backend = setup_backend(config.device, config.precision)
    except BackendError as exc:
        _print_error(exc)  # by every rank that finds it, as a ConfigError
        return 2
    try:
        train(config, backend, started)
        return 0
    except SharedError as exc:
        return exc.status  # printed by train, on rank 0
    except USER_ERRORS as exc:
        _print_error(exc)
        return exit_status(exc)
    finally:
        backend.close()


if __name__ == "__main__":
    sys.exit(main())
