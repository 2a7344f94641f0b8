"""The reference training workload: data-parallel fine-tuning on Trainium (XLA), CUDA or CPU.

Run it as a script under torchrun (``torchrun --nproc_per_node=N workload/train.py ...``);
the modules are split by concern:

- ``config``: the typed, validated training configuration (flags, YAML file).
- ``backend``: device selection and distributed setup (xla, cuda, cpu), one object the
  rest of the code talks to.
- ``data``: reading and validating the splits, tokenize-once memory-mapped cache, samplers.
- ``model``: the model and tokenizer (``tiny`` from a config, or a hub name / local path).
- ``engine``: the per-step training function and evaluation (shared with ``bench``).
- ``checkpoint``: atomic, portable checkpoints and automatic resume.
- ``metrics``: JSON lines, TensorBoard and progress output.
"""
