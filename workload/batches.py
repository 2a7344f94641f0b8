"""Batches: which examples each rank takes at each step, and the DataLoader over them.

Every batch has the same shape (static shapes for XLA): training drops the tail that does not
fill a step; evaluation pads its last batches with row -1, which ``TokenizedSplit`` turns into
a zero-weight copy of row 0.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from workload.data import DataError
from workload.token_cache import TokenizedSplit


class TrainBatches:
    """Index lists of this rank's training batches: a fresh shuffle every epoch, the tail
    that does not fill a whole step dropped (every batch has the same shape).

    Step ``b`` of epoch ``e`` takes examples ``perm[b*W*B : (b+1)*W*B]`` of the epoch's
    permutation (seeded by seed and epoch), and rank ``r`` its slice ``r*B : (r+1)*B``, so
    the order depends only on (seed, epoch, world size, batch size) and a resumed job can
    start in the middle of an epoch with ``set_position``.
    """

    def __init__(self, examples: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.examples = examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_step = batch_size * world_size
        self.steps_per_epoch = examples // self.per_step
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training split has {examples} examples, fewer than one step takes "
                f"(batch size {batch_size} x {world_size} processes)"
            )
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Start the next iteration at batch ``start`` of ``epoch``."""
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        perm = torch.randperm(self.examples, generator=generator).numpy()
        for step in range(self.start, self.steps_per_epoch):
            first = step * self.per_step + self.rank * self.batch_size
            yield perm[first : first + self.batch_size].tolist()


class EvalBatches:
    """Index lists of this rank's evaluation batches: all examples once, in order, the last
    batches padded with -1 so that every rank runs the same number of same-shape batches."""

    def __init__(self, examples: int, batch_size: int, rank: int, world_size: int):
        self.examples = examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        per_step = batch_size * world_size
        self.steps = -(-examples // per_step)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        per_step = self.batch_size * self.world_size
        for step in range(self.steps):
            first = step * per_step + self.rank * self.batch_size
            yield [i if i < self.examples else -1 for i in range(first, first + self.batch_size)]


def make_loader(
    split: TokenizedSplit,
    batches: TrainBatches | EvalBatches,
    *,
    num_workers: int,
    pin_memory: bool,
    seed: int,
) -> torch.utils.data.DataLoader[dict[str, torch.Tensor]]:
    """A DataLoader over whole batches (the split indexes a list of rows at once).

    It gets a generator of its own: creating an iterator then draws from it and not from
    the global RNG, which would shift dropout masks on a resume.
    """
    return torch.utils.data.DataLoader(
        split,  # type: ignore[arg-type]
        sampler=batches,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )
