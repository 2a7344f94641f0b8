"""The reference training workload: data-parallel fine-tuning on Trainium (XLA), CUDA or CPU.

Run it as a script under torchrun (``torchrun --nproc_per_node=N workload/train.py ...``);
the modules are split by concern:

- ``config``: the typed, validated training configuration (flags, YAML file).
- ``backend``: device selection and distributed setup (xla, cuda, cpu), one object the
  rest of the code talks to.
- ``data``: finding, reading and validating the splits.
- ``token_cache``: each split tokenized once into memory-mapped arrays.
- ``batches``: which examples each rank takes at each step (static shapes), the loader.
- ``model``: the model and tokenizer (``tiny`` from a config, or a hub name / local path).
- ``engine``: the per-step training function and evaluation (shared with ``bench``).
- ``checkpoint``: atomic, portable checkpoints and automatic resume.
- ``metrics``: JSON lines, TensorBoard and progress output.
- ``turns``: work the ranks do leader-first or a few at a time, errors shared by all.
- ``stop``: SIGTERM (stop at an agreed step, saved) and the hold that rehearsals of faults use.
- ``bench`` (the command line), ``bench_paths``, ``bench_rounds``, ``bench_device``,
  ``bench_stats``, ``bench_report``: the throughput benchmark against a plain loop and the
  Hugging Face ``Trainer``; ``step_graphs``: one against two XLA graphs per step.
"""

import os as _os

#: PJRT_DEVICE as the user set it. Importing transformers' model code imports torch-xla
#: when it is installed, and torch-xla then sets PJRT_DEVICE=CPU itself, so device
#: auto-detection reads this snapshot, taken when the package is first imported.
PJRT_DEVICE_AT_START = _os.environ.get("PJRT_DEVICE")
