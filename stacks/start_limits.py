"""What every node and rank of a job asks of shared storage when it starts (and when it saves),
against the documented limits of S3 and FSx for Lustre: the arithmetic that workload/train.py,
workload/turns.py and the storage stack follow. No CDK import, so tests and the CLI can use it.

A job on N trn1.32xlarge nodes runs 32 ranks a node (32,768 at 1,024 nodes), and they start
together: an access that every rank makes is N x 32 requests in the same second. Each access
below says who makes it (ONE: rank 0; PER_NODE: each node's local rank 0; PER_RANK: every
process), what it costs, against which limit, and how long it takes at that limit
(``seconds``) or how many requests a second it needs (``per_second``).

Limits, with their sources:

- S3: "your application can achieve at least 3,500 PUT/COPY/POST/DELETE or 5,500 GET/HEAD
  requests per second per partitioned Amazon S3 prefix"; above that S3 answers 503 Slow Down
  while it partitions the prefix, which takes time (Amazon S3 User Guide, "Best practices
  design patterns: optimizing Amazon S3 performance",
  https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html; AWS
  Knowledge Center, "Why am I getting 503 Slow Down errors from Amazon S3 when the requests
  are within the supported request rate per prefix?",
  https://repost.aws/knowledge-center/s3-503-within-request-rate-prefix). The compile cache
  is one prefix (stacks/storage.py COMPILE_CACHE_PREFIX), so a new bucket has 5,500 GET/s.
- FSx for Lustre PERSISTENT_2 SSD (stacks/storage.py; stacks/config.py: 1,200 GiB at
  250 MB/s/TiB unless set): per TiB, disk throughput 250 MB/s baseline (500 burst), network
  throughput 640 MB/s baseline, 6.8 GiB of file-server memory cache ("Performance
  characteristics of SSD and HDD storage classes",
  https://docs.aws.amazon.com/fsx/latest/LustreGuide/ssd-storage.html). Reads and writes here
  use the disk baseline (the slowest). Metadata: "The number of provisioned Metadata IOPS
  determines the maximum rate of metadata operations that can be supported by the file
  system"; for SSD the values are 1,500, 3,000, 6,000, 12,000 and multiples of 12,000 up to
  192,000 ("Managing metadata performance",
  https://docs.aws.amazon.com/fsx/latest/LustreGuide/managing-metadata-performance.html;
  FSx API Reference, FileSystemLustreMetadataConfiguration,
  https://docs.aws.amazon.com/fsx/latest/APIReference/API_FileSystemLustreMetadataConfiguration.html).
  Automatic mode provisions by storage capacity: 1,500 at 1,200 GiB, 3,000 at 2,400 GiB,
  6,000 from 4,800 to 9,600 GiB, 12,000 from 12,000 to 45,600 GiB, and 12,000 per 24,000 GiB
  from 48,000 GiB (the guide's "File system metadata performance" table,
  https://docs.aws.amazon.com/fsx/latest/LustreGuide/performance.html#dne-metadata-performance:
  FSX_AUTOMATIC_METADATA_IOPS). A metadata configuration cannot be added to a file system
  created without one, provisioned IOPS can only go up, and "You can't provision fewer
  Metadata IOPS than AUTOMATIC mode provisions for your file system" (botocore's fsx model,
  CreateFileSystemLustreMetadataConfiguration Iops): metadata_configuration() chooses the
  stack's. This module takes the smallest, 1,500, as its default, and counts one Metadata
  IOPS for each open and for each first look-up of a name by a node (a Lustre client caches
  the attributes it holds a lock for, so the other ranks of the node do not ask again): an
  upper bound on the cost.
- Network: a single TCP flow between instances of one cluster placement group reaches up to
  10 Gbps, 5 Gbps otherwise ("Amazon EC2 instance network bandwidth",
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-network-bandwidth.html);
  this module takes 5 Gbps. gloo broadcasts along a binomial tree, ceil(log2 n) rounds for n
  processes (gloo/broadcast.cc, in pytorch/pytorch's third_party/gloo).
- The Neuron persistent cache (NEURON_COMPILE_CACHE_URL, set by scripts/node/lib.sh
  export_job_environment): every process that meets a graph asks the cache for it ("Neuron
  Persistent Cache",
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/neuron-caching.html).
  The cache is /fsx/neuron-compile-cache, linked to the compile-cache bucket's prefix by a data
  repository association (stacks/storage.py), so the ranks ask the file system, not S3.
  libneuronxla's source is not public; a look-up in a local cache (its CompileCacheFs) is
  taken to cost, per process, an open of the entry's lock file, an flock taken and released on
  it (the ``model.hlo_module.pb.lock`` in each MODULE_<hash> entry of aws-neuron/
  optimum-neuron-cache's listing and of optimum-neuron's cache guide) and an open of
  model.neff: COMPILE_CACHE_RANK_OPS metadata operations, upper bound; and per node the first
  look-up of the entry's names (COMPILE_CACHE_LOOKUPS). The NEFF's bytes go once to each node
  (its page cache serves the node's ranks), from the file server's memory cache after the first
  read ("When a client accesses data that's stored in the in-memory or SSD cache, the file
  server doesn't need to read it from disk", FSx for Lustre user guide, "How FSx for Lustre
  file systems work", https://docs.aws.amazon.com/fsx/latest/LustreGuide/performance.html): at
  the network throughput baseline, 640 MB/s per TiB at 250 MB/s/TiB. What reaches S3 goes
  through the association, once per file, whatever the number of ranks: a file the file
  system lacks is loaded from S3 on its first read ("lazy load"), a new one exported after it
  is written ("Linking your file system to an S3 bucket",
  https://docs.aws.amazon.com/fsx/latest/LustreGuide/create-dra-linked-data-repo.html), taken
  as s3transfer's requests: one per small file, one per 8 MiB part (s3transfer/manager.py,
  TransferConfig multipart_threshold and multipart_chunksize). Before, with
  NEURON_COMPILE_CACHE_URL=s3://..., every process asked S3 itself: one HEAD and the GETs of
  the NEFF (optimum-neuron's CompileCacheHfProxy uses libneuronxla's CompileCache as
  ``exists(path)`` then ``download_file(path, dst)``, optimum/neuron/utils/hub_cache_utils.py),
  HERDS["compile cache look-up (per graph)"]. NEFF_BYTES is the largest model.neff in
  aws-neuron/optimum-neuron-cache's listing of a BERT-sized module (17.5 MB).

The start budget: each access must be served within START_BUDGET_S at these limits (at 1,024
nodes a minute of start costs 17 node-hours), and an S3 access must stay within the prefix's
request rate in the second in which all ranks make it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

MAX_NODES = 1_024
RANKS_PER_NODE = 32  # trn1.32xlarge: 16 Trainium chips x 2 NeuronCores, one rank each
START_BUDGET_S = 60.0

# -- limits ---------------------------------------------------------------------------------
S3_GET_PER_SECOND = 5_500  # GET/HEAD per partitioned prefix
S3_PUT_PER_SECOND = 3_500  # PUT/COPY/POST/DELETE per partitioned prefix
S3_PART_BYTES = 8 * 2**20  # s3transfer's multipart threshold and chunk size
FSX_STORAGE_GIB = 1_200  # stacks/config.py FSX_MIN_GIB, the default fsx_storage_gib
FSX_THROUGHPUT_PER_TIB = 250  # MB/s per TiB: stacks/config.py's default fsx_throughput_per_tib
#: Network throughput baseline per TiB for each PERSISTENT_2 SSD throughput tier (MB/s/TiB).
FSX_NETWORK_PER_TIB = {125: 320, 250: 640, 500: 1_300, 1_000: 2_600}
FSX_METADATA_IOPS = 1_500  # the smallest SSD Metadata IOPS (Automatic mode at 1,200 GiB)
FSX_METADATA_IOPS_VALUES = (1_500, 3_000, 6_000, *range(12_000, 192_001, 12_000))
#: Automatic mode's Metadata IOPS for an SSD file system: (from this storage capacity in GiB,
#: these IOPS), the guide's table row by row; from the last row on, 12,000 per 24,000 GiB.
FSX_AUTOMATIC_METADATA_IOPS = ((1_200, 1_500), (2_400, 3_000), (4_800, 6_000), (12_000, 12_000))
FSX_AUTOMATIC_IOPS_STEP_GIB = 24_000  # from 48,000 GiB: 12,000 Metadata IOPS per 24,000 GiB
AUTOMATIC, USER_PROVISIONED = "AUTOMATIC", "USER_PROVISIONED"  # the MetadataConfiguration modes
FLOW_BYTES_PER_SECOND = 5e9 / 8  # one TCP flow: 5 Gbps

# -- what the reference job moves (BERT-base fine-tuning, docs/performance.md) ---------------
MODEL_BYTES = 110_000_000 * 4  # about 110 M parameters in fp32: model.safetensors
STATE_BYTES = 2 * MODEL_BYTES  # AdamW's exp_avg and exp_avg_sq: trainer_state.pt
#: One rank's RNG state as train.py saves it (python, numpy, torch): 14,623 bytes pickled,
#: measured with ``pickle.dumps(Backend(kind="cpu", ...).rng_state())``.
RNG_BYTES = 14_623
#: Files a process looks up to load a tokenizer directory with AutoTokenizer (52 look-ups of
#: which 6 opens: strace -e openat,stat,newfstatat,statx of load_tokenizer on a saved tiny
#: tokenizer).
TOKENIZER_LOOKUPS = 52
TOKENIZER_OPENS = 6
TOKENIZER_BYTES = 1_000_000  # a 30,522-entry WordPiece tokenizer pickles to well under 1 MB
#: Amazon Polarity (3.6 M train + 0.4 M test examples) at 128 tokens: int32 input_ids,
#: int8 token_type_ids, int32 lengths, int64 labels per example.
TOKEN_CACHE_BYTES = 4_000_000 * (128 * 4 + 128 + 4 + 8)
#: Files a rank opens to open both splits of the token cache (workload/token_cache.py
#: TokenizedSplit: meta.json and four memory-mapped arrays each).
TOKEN_CACHE_OPENS = 2 * (1 + 4)
NEFF_BYTES = 17_500_000
#: Files of a compile-cache entry besides model.neff: model.hlo_module.pb, compile_flags.json,
#: model.done (optimum-neuron's cache guide, "Directory Layout").
COMPILE_CACHE_SMALL_FILES = 3
#: Names a node's client looks up once per entry: the compiler's version directory, the
#: MODULE_<hash> directory, model.neff, model.done, model.log, model.hlo_module.pb.lock.
COMPILE_CACHE_LOOKUPS = 6
#: Metadata operations of one process per entry: open the lock file, flock and unlock it,
#: open model.neff.
COMPILE_CACHE_RANK_OPS = 4
#: Files of a checkpoint (model.safetensors, config.json, the tokenizer's, trainer_state.pt,
#: train_config.yaml): what the data repository association exports to S3 after a save.
CHECKPOINT_FILES = 8

ONE, PER_NODE, PER_RANK = "rank 0", "each node's local rank 0", "every rank"


def fsx_read_bytes_per_second(storage_gib: int = FSX_STORAGE_GIB) -> float:
    """The file system's disk throughput, baseline (bytes a second)."""
    return storage_gib / 1024 * FSX_THROUGHPUT_PER_TIB * 1e6


def fsx_network_bytes_per_second(storage_gib: int = FSX_STORAGE_GIB) -> float:
    """The file system's network throughput, baseline (bytes a second): what the file server
    sends from its memory cache."""
    return storage_gib / 1024 * FSX_NETWORK_PER_TIB[FSX_THROUGHPUT_PER_TIB] * 1e6


def tree_seconds(payload: int, processes: int) -> float:
    """A gloo broadcast of ``payload`` bytes to ``processes``: ceil(log2) rounds of one flow."""
    return math.ceil(math.log2(processes)) * payload / FLOW_BYTES_PER_SECOND if processes > 1 else 0


def count(who: str, nodes: int, ranks: int) -> int:
    return {ONE: 1, PER_NODE: nodes, PER_RANK: nodes * ranks}[who]


@dataclass(frozen=True)
class Figure:
    demand: float
    limit: float
    unit: str  # "requests/s" (demand is a peak rate) or "s" (demand is a duration)

    @property
    def within(self) -> bool:
        return self.demand <= self.limit


@dataclass(frozen=True)
class Access:
    name: str
    who: str  # ONE, PER_NODE or PER_RANK: who makes it in the code as it is
    service: str
    figure: Callable[[int, int, int], Figure]  # (nodes, ranks per node, metadata IOPS)


def _metadata(ops: float, iops: int) -> Figure:
    return Figure(ops / iops, START_BUDGET_S, "s")


def compile_cache_lookup(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """Every process looks each graph up in the cache on /fsx as it meets it, all at once:
    its own opens and flocks; the names once a node."""
    ops = nodes * COMPILE_CACHE_LOOKUPS + count(PER_RANK, nodes, ranks) * COMPILE_CACHE_RANK_OPS
    return _metadata(ops, iops)


def compile_cache_read(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """Each node reads a graph's NEFF once (its page cache serves its ranks), from the file
    server's memory."""
    return Figure(nodes * NEFF_BYTES / fsx_network_bytes_per_second(), START_BUDGET_S, "s")


def _compile_cache_requests() -> int:
    """S3 requests for one entry's files: one per small file, one per part of the NEFF."""
    return COMPILE_CACHE_SMALL_FILES + math.ceil(NEFF_BYTES / S3_PART_BYTES)


def compile_cache_import(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """An entry the file system lacks (a new file system's) is loaded from S3 by the data
    repository association on its first read, once, whatever the number of ranks."""
    return Figure(_compile_cache_requests(), S3_GET_PER_SECOND, "requests/s")


def compile_cache_export(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """A newly compiled entry goes to S3 through the association (its lock file's creation
    and deletion too)."""
    return Figure(_compile_cache_requests() + 2, S3_PUT_PER_SECOND, "requests/s")


def compile_cache_s3_lookup(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """Before: NEURON_COMPILE_CACHE_URL=s3://..., every process asked S3 for each graph (one
    HEAD, then the NEFF's GETs), all at once."""
    requests = 1 + math.ceil(NEFF_BYTES / S3_PART_BYTES)
    return Figure(count(PER_RANK, nodes, ranks) * requests, S3_GET_PER_SECOND, "requests/s")


def tokenizer(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS, who: str = ONE) -> Figure:
    """Rank 0 loads the tokenizer; the others receive it as an object (read_once)."""
    loaders = count(who, nodes, ranks)
    lookups = min(loaders, nodes) * (TOKENIZER_LOOKUPS - TOKENIZER_OPENS)
    seconds = (lookups + loaders * TOKENIZER_OPENS) / iops
    if who == ONE:
        seconds += tree_seconds(TOKENIZER_BYTES, nodes)
    return Figure(seconds, START_BUDGET_S, "s")


def token_cache_fill(
    nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS, who: str = ONE
) -> Figure:
    """Tokenizing and writing the cache: rank 0 (main_then_nodes), the other nodes' leaders
    only check that the two split directories are there."""
    writers = count(who, nodes, ranks)
    seconds = writers * TOKEN_CACHE_BYTES / fsx_read_bytes_per_second() + 2 * nodes / iops
    return Figure(seconds, START_BUDGET_S, "s")


def token_cache_open(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """Every rank opens meta.json and memory-maps the arrays of both splits."""
    return _metadata(count(PER_RANK, nodes, ranks) * TOKEN_CACHE_OPENS, iops)


def resume_weights(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS, who: str = ONE) -> Figure:
    """model.safetensors: read by rank 0, which broadcast_parameters (and DDP) copies to every
    rank. Ranks of one node share the node's page cache: the file server sends it once a node."""
    readers = count(who, nodes, ranks)
    seconds = min(readers, nodes) * MODEL_BYTES / fsx_read_bytes_per_second() + readers / iops
    return Figure(seconds, START_BUDGET_S, "s")


def resume_state(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS, who: str = ONE) -> Figure:
    """trainer_state.pt: read by rank 0 (read_once), broadcast down the node tree; each rank's
    RNG state is scattered to it alone."""
    readers = count(who, nodes, ranks)
    size = STATE_BYTES + nodes * ranks * RNG_BYTES
    seconds = min(readers, nodes) * size / fsx_read_bytes_per_second() + readers / iops
    if who == ONE:
        seconds += tree_seconds(STATE_BYTES, nodes)
    return Figure(seconds, START_BUDGET_S, "s")


def rng_gather(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """The RNG states of every rank at each save, gathered to rank 0 alone (gather_object),
    which receives them over its flows; an all-gather gave each of the 32 ranks of every node
    all of them too (479 MB each at 1,024 nodes), for nothing."""
    return Figure(nodes * ranks * RNG_BYTES / FLOW_BYTES_PER_SECOND, START_BUDGET_S, "s")


def checkpoint_write(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """Rank 0 writes the checkpoint (model, trainer state with every rank's RNG state)."""
    size = MODEL_BYTES + STATE_BYTES + nodes * ranks * RNG_BYTES
    return Figure(
        size / fsx_read_bytes_per_second() + 2 * CHECKPOINT_FILES / iops, START_BUDGET_S, "s"
    )


def checkpoint_export(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """The jobs data repository association exports a new checkpoint's files to S3 (PUTs)."""
    parts = CHECKPOINT_FILES + math.ceil((MODEL_BYTES + STATE_BYTES) / S3_PART_BYTES)
    return Figure(parts, S3_PUT_PER_SECOND, "requests/s")


def resume_point(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS, keep: int = 3) -> Figure:
    """Under xla every rank lists the checkpoints for its stochastic-rounding seed
    (train.py stochastic_rounding_seed): look-ups a node's client caches, no opens."""
    return _metadata(nodes * (1 + 4 * keep), iops)


def data_dir(nodes: int, ranks: int, iops: int = FSX_METADATA_IOPS) -> Figure:
    """Rank 0 resolves --data (downloading a hub data set once); each node's leader checks it."""
    return _metadata(nodes, iops)


#: Every start- and save-time access of the project, as the code makes it now.
ACCESSES = (
    Access("compile cache look-up (per graph)", PER_RANK, "FSx metadata", compile_cache_lookup),
    Access(
        "compile cache read (per graph)", PER_NODE, "FSx read (server cache)", compile_cache_read
    ),
    Access("compile cache import (per graph)", ONE, "S3 GET (association)", compile_cache_import),
    Access(
        "compile cache export (per new graph)", ONE, "S3 PUT (association)", compile_cache_export
    ),
    Access("data directory", PER_NODE, "FSx metadata", data_dir),
    Access("tokenizer", ONE, "FSx metadata + gloo", tokenizer),
    Access("token cache fill", ONE, "FSx write", token_cache_fill),
    Access("token cache open", PER_RANK, "FSx metadata", token_cache_open),
    Access("resume: model weights", ONE, "FSx read", resume_weights),
    Access("resume: trainer state", ONE, "FSx read + gloo", resume_state),
    Access("resume point (xla)", PER_NODE, "FSx metadata", resume_point),
    Access("save: RNG states", ONE, "gloo", rng_gather),
    Access("save: checkpoint write", ONE, "FSx write", checkpoint_write),
    Access("save: export to S3", ONE, "S3 PUT", checkpoint_export),
)

#: The same accesses as the code made them before they were shared: the herds.
HERDS = {
    "compile cache look-up (per graph)": compile_cache_s3_lookup,
    "tokenizer": lambda n, r, i=FSX_METADATA_IOPS: tokenizer(n, r, i, who=PER_RANK),
    "token cache fill": lambda n, r, i=FSX_METADATA_IOPS: token_cache_fill(n, r, i, who=PER_NODE),
    "resume: model weights": lambda n, r, i=FSX_METADATA_IOPS: resume_weights(
        n, r, i, who=PER_RANK
    ),
    "resume: trainer state": lambda n, r, i=FSX_METADATA_IOPS: resume_state(n, r, i, who=PER_RANK),
}


def figures(
    nodes: int, ranks: int = RANKS_PER_NODE, iops: int = FSX_METADATA_IOPS
) -> dict[str, Figure]:
    """Each access's demand and limit on ``nodes`` nodes of ``ranks`` processes."""
    if not 1 <= nodes <= MAX_NODES or ranks < 1:
        raise ValueError(f"nodes {nodes} is not 1 to {MAX_NODES}, or ranks {ranks} is below 1")
    return {access.name: access.figure(nodes, ranks, iops) for access in ACCESSES}


def metadata_iops_needed(nodes: int, ranks: int = RANKS_PER_NODE) -> int:
    """The smallest Metadata IOPS value FSx offers with which every metadata access on
    ``nodes`` nodes fits the start budget (what stacks/storage.py should provision)."""
    for iops in FSX_METADATA_IOPS_VALUES:
        metadata = [a for a in ACCESSES if "metadata" in a.service]
        if all(a.figure(nodes, ranks, iops).within for a in metadata):
            return iops
    raise ValueError(f"no Metadata IOPS value serves {nodes} nodes within the budget")


def automatic_metadata_iops(storage_gib: int) -> int:
    """The Metadata IOPS that Automatic mode provisions for an SSD file system of
    ``storage_gib`` (FSX_AUTOMATIC_METADATA_IOPS), at most the largest value FSx offers."""
    if storage_gib < FSX_AUTOMATIC_METADATA_IOPS[0][0]:
        raise ValueError(f"storage {storage_gib} GiB is below FSx for Lustre's smallest, 1,200")
    per_step = FSX_AUTOMATIC_METADATA_IOPS[-1][1]
    if storage_gib >= 2 * FSX_AUTOMATIC_IOPS_STEP_GIB:
        steps = storage_gib // FSX_AUTOMATIC_IOPS_STEP_GIB
        return min(steps * per_step, FSX_METADATA_IOPS_VALUES[-1])
    return max(iops for gib, iops in FSX_AUTOMATIC_METADATA_IOPS if gib <= storage_gib)


@dataclass(frozen=True)
class MetadataConfiguration:
    """The file system's MetadataConfiguration: its mode, and the Metadata IOPS it has."""

    mode: str  # AUTOMATIC or USER_PROVISIONED
    iops: int  # what the file system gets: Automatic mode's figure, or the provisioned value

    @property
    def properties(self) -> dict[str, str | int]:
        """As CloudFormation takes it: Iops only when provisioned ("If you're using AUTOMATIC
        mode, you cannot specify a value", botocore's fsx model)."""
        if self.mode == AUTOMATIC:
            return {"Mode": AUTOMATIC}
        return {"Mode": USER_PROVISIONED, "Iops": self.iops}


def metadata_configuration(nodes: int, storage_gib: int) -> MetadataConfiguration:
    """The metadata configuration a file system of ``storage_gib`` needs for ``nodes`` nodes.

    Always one: a file system created without one can never get one, so a cluster deployed
    small could never grow (FSx for Lustre user guide, "Managing metadata performance").
    Automatic mode where its IOPS serve the nodes (it grows with storage capacity on its
    own); otherwise the smallest value that serves them, provisioned: above Automatic mode's
    figure, as FSx requires."""
    needed = metadata_iops_needed(nodes)
    automatic = automatic_metadata_iops(storage_gib)
    if needed <= automatic:
        return MetadataConfiguration(AUTOMATIC, automatic)
    return MetadataConfiguration(USER_PROVISIONED, needed)
