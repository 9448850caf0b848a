"""The contract between the coordinator and the nodes: what a job asks for and what a node is told.

Both sides import these pydantic models (`coordinator/` and `node/` never import each other).
Everything here is plain data: architecture names and configs, never code.
"""
from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from ravnest.averaging.registry import (AUTO, NO_AVERAGING, available_strategies, is_strategy, registered,
                                        strategy_info)
from ravnest.errors import did_you_mean
from ravnest.failures import Failure
from ravnest.wire import codecs
from ravnest.telemetry import MAX_FIGURES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `true` is not 1 step, "30" is not 30


# a block range: JSON has no tuples, and parsed JSON (lists) must validate as well as JSON text
BlockRange = Annotated[tuple[int, int], Field(strict=False)]


MAX_STEPS = 100_000_000  # hard bounds on what any spec may say; the coordinator's own limits are tighter
MAX_CONFIG_BYTES = 16 << 10
MAX_NESTING = 4


AUTO_CODEC = "auto"  # training.codec: the planner picks each link's


def _known_codec(name: str, use: str) -> str:
    if name not in codecs.names(use):
        raise ValueError(f"{name[:32]!r} is not a codec for {'the pipeline' if use == 'pipeline' else use}"
                         f"{did_you_mean(name, codecs.names(use))}; choose one of "
                         f"{', '.join(repr(n) for n in codecs.names(use))}")
    return name


def _plain_json(value: Any, where: str) -> Any:
    """A small, shallow JSON value (configs and kwargs): no 300-level nesting, no megabytes of it."""
    def depth(v: Any) -> int:
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        return 0
    if depth(value) > MAX_NESTING:
        raise ValueError(f"{where} nests deeper than {MAX_NESTING} levels")
    if len(repr(value)) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where} is longer than {MAX_CONFIG_BYTES} characters")
    return value


DATASET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
FINGERPRINT = r"^[0-9]{1,15}:[0-9a-f]{64}$"  # "<size>:<sha256>" of an offered file (ravnest/data/proof.py)
SHA256 = r"^[0-9a-f]{64}$"
HEX_NONCE = r"^[0-9a-f]{32}$"


class StartingWeights(_Strict):
    """Weights a job starts from (fine-tuning): a safetensors file volunteers offer, read by each stage
    for its own tensors only (ravnest/models/weights.py)."""
    source: str = Field(pattern=DATASET_NAME, description=(
        "the name volunteers offer the file under (`ravnest-node join --model-file NAME=PATH`): a Hugging Face "
        "checkpoint's model.safetensors (llama) or a `ravnest download`. The job runs only on nodes that proved "
        "they hold it"))
    sha256: str | None = Field(None, pattern=SHA256, description=(
        "the sha256 of the file's bytes (`ravnest-node join` prints it); unset, the coordinator pins the content "
        "most proven holders offer when the job is first placed"))


class ModelRef(_Strict):
    name: str = Field(max_length=64, description="architecture in the registry, e.g. 'cnn', 'mlp', 'gpt'")
    config: dict[str, Any] = Field(default_factory=dict, description="JSON config for the builder")
    weights: StartingWeights | None = Field(None, description=(
        "start from these weights instead of the seed's random ones (fine-tuning)"))

    @field_validator("config")
    @classmethod
    def _small(cls, config: dict[str, Any]) -> dict[str, Any]:
        return _plain_json(config, "model.config")


class DatasetRef(_Strict):
    name: Literal["digits", "text", "tokens", "npz"] = Field(description=(
        "'digits' (scikit-learn's, on every node), 'text' (a file's bytes), 'tokens' (a token file from "
        "`ravnest data prepare`), 'npz' (arrays)"))
    source: str | None = Field(None, pattern=DATASET_NAME, description=(
        "for 'text', 'tokens' and 'npz': the name a volunteer offers a file under (`ravnest-node join --dataset "
        "NAME=PATH`); the job runs only on nodes that proved they hold it. Never a path: a volunteer's files "
        "are theirs"))
    sha256: str | None = Field(None, pattern=SHA256, description=(
        "with `source`: the sha256 of the file's bytes (`ravnest-node join --dataset` prints it). The job reads "
        "only that content, on nodes that proved they hold it; unset, the coordinator pins the content most "
        "proven holders offer under `source` when the job is first placed"))
    seq_len: PositiveInt = Field(64, le=1 << 16, description="'text' and 'tokens': tokens (a text's bytes) per "
                                                             "training sequence")
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    shards: Literal["interleaved", "by-label"] = Field("interleaved", description=(
        "how data-parallel replicas split the training data: 'interleaved' (every k-th example, so each "
        "sees every class) or 'by-label' (sorted by label, then cut in contiguous parts, so each sees a few "
        "classes: the heterogeneous-data setting of decentralized training; classification only)"))

    @model_validator(mode="before")
    @classmethod
    def _no_paths(cls, data: Any) -> Any:
        if isinstance(data, dict) and "path" in data:
            raise ValueError("a job never names a file on a volunteer's machine: name a dataset the nodes offer "
                             "(dataset.source; volunteers offer files with `ravnest-node join --dataset NAME=PATH`)")
        return data

    @model_validator(mode="after")
    def _content_of_a_file(self) -> DatasetRef:
        if self.sha256 is not None and self.source is None:
            raise ValueError("dataset.sha256 pins the content of an offered file: give dataset.source too")
        return self

    @model_validator(mode="after")
    def _labels_to_shard_by(self) -> DatasetRef:
        if self.shards == "by-label" and self.name in ("text", "tokens"):
            raise ValueError("shards 'by-label' needs a classification dataset; 'text' has no labels")
        return self


class OptimizerRef(_Strict):
    name: str = Field("Adam", max_length=64, description="any torch.optim class name, or AccumAdam / AccumAdamW "
                      "(Adam whose moments advance every `accumulation` steps: ravnest/pipeline/accum_adam.py)")
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-3})

    @field_validator("kwargs")
    @classmethod
    def _small(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return _plain_json(kwargs, "optimizer.kwargs")


class TrainingSettings(_Strict):
    steps: PositiveInt = Field(300, le=MAX_STEPS, description="optimizer steps per stage (per cluster)")
    batch_size: PositiveInt = Field(32, le=1 << 16)
    microbatches_in_flight: int | None = Field(
        None, ge=1, le=1024, description="staleness bound K; default = number of stages")
    accumulation: PositiveInt = Field(1, le=4096, description="micro-batches per optimizer step")
    optimizer: OptimizerRef = Field(default_factory=OptimizerRef)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    weight_stash: Literal["stash", "recompute"] = Field(
        "stash", description="keep forward weights + activations, or weights + RNG and recompute")
    staleness: Literal["auto", "2bw+predict", "2bw+predict2", "2bw", "predict", "predict2", "none"] = Field(
        "auto", description="staleness compensation of the asynchronous pipeline: '2bw' cuts each batch into K "
        "micro-batches whose gradients make one update (PipeDream-2BW: at most one update of delay); 'predict' "
        "forwards with the weights extrapolated to when the gradient is applied (SpecTrain/XPipe), 'predict2' "
        "along the change of the update too (second order); '2bw+predict', '2bw+predict2' both; 'none'; "
        "'auto' (default) is 'predict2' for K <= 2 and '2bw+predict2' above, as measured in docs/pipeline.md")
    codec: str = Field("", max_length=32, description=(
        "how activations and their gradients cross the wire: '' as computed, 'fp16', 'bf16', or 'auto': the "
        "planner picks per link, bf16 only where the link at full precision would slow its stages "
        "(ravnest/wire/codecs, docs/links.md)"))
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description=(
        "bf16, fp16: each stage computes under autocast in that type where its hardware has its arithmetic (else "
        "in float32, saying so), with float32 weights, gradients and optimizer state. bf16's stages exchange "
        "bf16 (unless `codec` says otherwise); fp16 scales each stage's gradients (dynamic loss scaling, per "
        "stage) and exchanges float32"))
    grad_clip: float | None = Field(None, gt=0, description=(
        "clip each stage's gradient to this norm before its optimizer step. Per stage, not global: the "
        "stages' gradients are never gathered in one place, so the whole model's norm stays within "
        "grad_clip x sqrt(stages). Under DeAR, which applies a stage's update in parts, per part"))
    activation_checkpointing: bool = Field(False, description=(
        "keep only each block's input from forward to backward and recompute the block's activations in its "
        "backward: far less memory for about a third more compute; the backward is then not split into input "
        "and weight halves (a deferred weight gradient would need what was dropped)"))
    eval_every: int = Field(0, ge=0, le=MAX_STEPS, description="steps between evaluations; 0 = only at the end")
    seed: int = Field(0, ge=0, lt=1 << 63)

    @field_validator("codec")
    @classmethod
    def _pipeline_codec(cls, name: str) -> str:
        return name if name == AUTO_CODEC else _known_codec(name, "pipeline")


class AveragingSettings(_Strict):
    """The settings every strategy shares; a strategy's own sit under its name (ravnest/averaging/registry.py),
    e.g. `{"strategy": "acid", "acid": {"rate": 0.25}}`, and are read with `of(name)`."""
    model_config = ConfigDict(extra="allow", strict=True)  # extra keys: strategies' sections, checked below

    strategy: str = Field("ring", description="how clusters average their copies of each segment: 'ring' "
                          "(periodic multi-ring all-reduce), 'diloco' (H local steps, then an outer optimizer step on "
                          "the averaged pseudo-gradient), 'dear' (every step's gradients, all-reduce hidden "
                          "behind backward and forward: synchronous data parallelism), 'dsgd' / 'dadam' (gossip "
                          "with the neighbours of `topology`), 'ada' (gossip whose graph adapts to how far the "
                          "replicas drift apart), 'acid' (asynchronous pairwise averaging with a continuous "
                          "momentum), 'auto' (the planner picks the fastest by its runtime model), 'none', or an "
                          "installed plug-in strategy (docs/averaging.md)")
    topology: str = Field("one-peer-exp", description="whom gossip strategies mix with each round: complete, ring, "
                          "torus, exponential, one-peer-exp, alternating-exp-ring")
    paced: bool | None = Field(None, description="gossip: a member sends its vector only when the receiver asks, "
                               "one neighbour at a time, so a slow link carries one vector at a time. None: the "
                               "planner decides (paced where a segment takes longer on the slowest link than a "
                               "step's compute); off where no planner ran (docs/averaging.md)")
    every: PositiveInt = Field(50, le=MAX_STEPS, description="local optimizer steps between averaging rounds")
    every_seconds: float | None = Field(
        None, gt=0, le=86400, description="seconds between rounds instead of `every` steps (clusters of unequal speed)")
    codec: str = Field("", max_length=32, description=(
        "how replicas' vectors cross the wire: '' raw, 'fp16', 'bf16', 'int8', or 'topk' (1.56% of the values "
        "with error feedback, all-gathered; diloco only), or 'auto': the planner picks the least lossy one "
        "whose rounds keep up with training (ravnest/wire/codecs, docs/links.md)"))
    backend: Literal["grpc", "torch"] = Field(
        "grpc", description="'grpc': collectives over the authenticated peer wire (the default, and the only "
                            "choice across the internet); 'torch': over torch.distributed's gloo, for trusted "
                            "clusters whose members reach each other directly. gloo has NO authentication: "
                            "see docs/security.md")
    average_optimizer_state: bool = Field(
        False, description="also average the optimizer's per-parameter state (e.g. Adam's moments)")

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, data: Any) -> Any:
        """Specs written before strategies had sections of their own named their options flat
        (`acid_rate`, `fusion_mb`, ...): they are read into the strategy's section (a nested value wins)."""
        if not isinstance(data, dict):
            return data
        flat = {key: (info.name, option) for info in registered() for key, option in info.flat_keys.items()}
        if not flat.keys() & data.keys():
            return data
        nested: dict[str, Any] = {}
        for key in flat.keys() & data.keys():
            name, option = flat[key]
            nested.setdefault(name, {})[option] = data[key]
        rest = {key: value for key, value in data.items() if key not in flat}
        for name, options in nested.items():
            given = rest.get(name, {})
            rest[name] = {**options, **given} if isinstance(given, dict) else given
        return rest

    @field_validator("codec")
    @classmethod
    def _averaging_codec(cls, name: str) -> str:
        return name if name == AUTO_CODEC else _known_codec(name, "averaging")

    @property
    def sent_codec(self) -> str:
        """The codec replicas send with: the job's, or raw where it said "auto" and no planner picked one."""
        return "" if self.codec == AUTO_CODEC else self.codec

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, name: str) -> str:
        if not is_strategy(name):
            raise ValueError(f"unknown averaging strategy {name!r}; known: {', '.join(available_strategies())}")
        return name

    @field_validator("topology")
    @classmethod
    def _known_topology(cls, name: str) -> str:
        from ravnest.averaging.topology import TOPOLOGIES  # its package imports this module
        if name not in TOPOLOGIES:
            raise ValueError(f"unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)}")
        return name

    @model_validator(mode="after")
    def _strategy_sections(self) -> AveragingSettings:
        sections = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        for name, given in sections.items():
            if name in (AUTO, NO_AVERAGING) or not is_strategy(name):
                raise ValueError(f"unknown averaging setting {name!r}: the shared ones are "
                                 f"{', '.join(type(self).model_fields)}; a strategy's own go under its name, "
                                 f'e.g. "acid": {{"rate": 0.25}}')
            try:
                sections[name] = strategy_info(name).settings.model_validate(given).model_dump()
            except ValidationError as exc:
                problems = "; ".join(("".join(f"{part}: " for part in e["loc"][:1]) + e["msg"])
                                     .replace("Value error, ", "") for e in exc.errors())
                raise ValueError(f"averaging.{name}: {problems}") from None
        if self.sent_codec and not codecs.codec(self.sent_codec).reduces \
                and not strategy_info(self.strategy).averages_changes:
            raise ValueError(f"codec {self.codec!r} keeps a few of a vector's values and delays the rest, which "
                             f"suits changes, not weights: use it with a strategy that averages changes: "
                             f"{', '.join(i.name for i in registered() if i.averages_changes)}")
        if self.every_seconds is not None and not strategy_info(self.strategy).by_seconds:
            raise ValueError(f"'{self.strategy}' averages by steps; `every_seconds` is for strategies that "
                             f"average by the clock: {', '.join(i.name for i in registered() if i.by_seconds)}")
        return self

    def of(self, strategy: str) -> Any:
        """Strategy `strategy`'s own settings model: what the job gave under its name, else its defaults."""
        return strategy_info(strategy).settings.model_validate((self.__pydantic_extra__ or {}).get(strategy, {}))


class Placement(_Strict):
    clusters: Annotated[int, Field(ge=1, le=10_000)] | Literal["auto"] = "auto"
    min_nodes: PositiveInt | None = Field(None, le=100_000,
                                          description="wait in 'pending' until at least this many idle nodes "
                                                      "joined (default: what clusters x stages_per_cluster asks "
                                                      "for, as far as they are given; else 1)")
    timeout_s: float | None = Field(None, gt=0, le=366 * 86400,
                                    description="fail a job still pending after this many seconds "
                                                "(default: wait as long as it takes)")
    max_recoveries: int = Field(3, ge=0, le=1000,
                                description="re-plans after a lost node or a failed stage before the job fails")
    max_nodes: PositiveInt | None = Field(None, le=100_000,
                                          description="use at most this many nodes (default: all idle ones)")
    stages_per_cluster: int | None = Field(None, ge=1, le=4096, description="default: every node in the cluster")
    policy: Literal["measured", "equal-split"] = Field(
        "measured", description="measured: clusters by measured bandwidth and compute, cuts by predicted time; "
                                "equal-split: Ravnest's original policy, the baseline bench.testbed measures "
                                "against (clusters by memory in join order, equal parameters per stage, rings "
                                "in join order)")

    @model_validator(mode="after")
    def _nodes_the_shape_needs(self) -> Placement:
        """A job that asks for 2 clusters of 2 stages waits for 4 nodes without saying so twice."""
        if self.min_nodes is None:
            clusters = self.clusters if isinstance(self.clusters, int) else 1
            self.min_nodes = min(clusters * (self.stages_per_cluster or 1), self.max_nodes or 100_000)
        return self


class CheckpointSettings(_Strict):
    every: int = Field(100, ge=0, le=MAX_STEPS, description="optimizer steps between checkpoints of cluster 0's stages "
                                              "(parameters, optimizer state, step); 0 = none")
    every_seconds: float | None = Field(None, ge=1, le=86400,
                                        description="also checkpoint when this many seconds passed since the last "
                                                    "one (whichever of the two comes first); None = by steps only")


class JobSpec(_Strict):
    name: str = Field("", max_length=256)
    model: ModelRef
    dataset: DatasetRef
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    averaging: AveragingSettings = Field(default_factory=AveragingSettings)
    placement: Placement = Field(default_factory=Placement)
    checkpoints: CheckpointSettings = Field(default_factory=CheckpointSettings)


class RelayOffer(_Strict):
    """A relay (ravnest/relay) this node may listen on: peers could not dial it directly."""
    address: str = Field(max_length=300, description=(
        "host:port of the relay; no host (':8471') means the coordinator's own host, as this node reaches it"))
    token: str = Field(max_length=128, description="shows the relay that the coordinator sent this node")


class StagePeer(_Strict):
    node_id: str
    address: str = Field(description="host:port of the node's gRPC server")
    tls_name: str | None = Field(None, max_length=255, description=(
        "the name its TLS certificate carries where that is not the address's host: a node reached through a "
        "relay is dialled at the relay"))
    codec: str | None = Field(None, max_length=32, description=(
        "the pipeline codec on the link to this neighbour, both ways (the planner's pick where training.codec "
        "is 'auto'); None: the job's"))
    listen_at: RelayOffer | None = Field(None, description=(
        "peers cannot dial you, and this one they can: listen at its relay for its peers, and it sends to you "
        "over the connection you opened there rather than through your relay"))
    dials_out: bool = Field(False, description=(
        "peers cannot dial this one, and it listens at your relay for your peers: send to it through there"))

    @field_validator("codec")
    @classmethod
    def _pipeline_codec(cls, name: str | None) -> str | None:
        return name if name is None else _known_codec(name, "pipeline")


class Ring(_Strict):
    """One parameter segment (a block range) and the node holding it in each cluster."""
    segment: int
    blocks: BlockRange
    members: list[StagePeer]
    weights: list[float] | None = Field(
        None, description="share of the vector each member reduces, in ring order (default equal); "
                          "balanced against the members' bandwidth")
    order: list[int] | None = Field(
        None, description="member indices (clusters) in the order the all-reduce passes shares around; "
                          "None: 0, 1, ..., n-1. Chosen for the widest slowest link")

    @model_validator(mode="after")
    def _order_is_a_permutation(self) -> "Ring":
        if self.order is not None and sorted(self.order) != list(range(len(self.members))):
            raise ValueError(f"ring order {self.order} is not an order of its {len(self.members)} members")
        return self


class StageAssignment(_Strict):
    """Everything a node needs to run its stage of one job."""
    job_id: str
    generation: int = Field(0, description="how many times the job was re-planned (after a loss, or a resume)")
    resume_step: int = Field(0, description="the step training continues from; > 0: fetch this stage's state "
                                            "(parameters, optimizer state) from the coordinator first")
    token: str = Field(description="this node's own gRPC credential for this job generation")
    peer_credentials: dict[str, str] = Field(
        default_factory=dict, max_length=100_000,
        description="node id -> SHA-256 (hex) of its credential, for every node of this job generation: calls "
                    "are accepted from the neighbours and ring peers named here, and no stage can pose as another")
    cluster: int
    num_clusters: int
    stage: int
    num_stages: int
    blocks: BlockRange = Field(description="half-open range of block indices")
    input_shape: list[int] | None = Field(
        None, description="shape of the activations this stage receives for a micro-batch of "
                          "training.batch_size (batch first; sequence length may be shorter); None on stage 0")
    input_dtype: str = Field("float32", description="their dtype, e.g. 'float32'")
    predicted_memory_bytes: int | None = Field(None, description="what the planner predicts this stage holds")
    split_backward: bool = Field(True, description="split the backward into input and weight halves (off where "
                                                   "memory does not allow it)")
    model: ModelRef
    dataset: DatasetRef
    training: TrainingSettings
    averaging: AveragingSettings
    prev: StagePeer | None = None
    next: StagePeer | None = None
    rings: list[Ring] = Field(default_factory=list, description="rings this node is a member of")
    checkpoint_every: int = Field(0, description="steps between checkpoints this stage uploads; 0 = none")
    checkpoint_every_s: float | None = Field(None, description="seconds between checkpoints (stage 0 picks the step)")

    def peers(self) -> list[StagePeer]:
        """Its pipeline neighbours and the members of its rings (itself among them)."""
        return [*(p for p in (self.prev, self.next) if p is not None),
                *(member for ring in self.rings for member in ring.members)]

    def peer_addresses(self) -> dict[str, str]:
        """The planned peers' node ids by address: a failure names its peer by id (ravnest/failures.py)."""
        return {p.address: p.node_id for p in self.peers()}

    def planned_peers(self) -> set[str]:
        """The nodes that may call this stage: its pipeline neighbours and the other members of its rings."""
        return {p.node_id for p in self.peers()}

    def tls_names(self) -> dict[str, str]:
        """address -> the name its certificate carries, for the peers this stage dials at a relay."""
        return {p.address: p.tls_name for p in self.peers() if p.tls_name}


# --- node <-> coordinator REST bodies -------------------------------------------------------------

class _Measured(_Strict):
    """Figures the planner computes with, within physical ranges: "Infinity", "NaN", 5e-324 FLOP/s or
    `false` seconds would poison every plan (strict: a boolean or a string is not a number)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# plausible ranges, from a phone to a datacentre node
FLOPS: dict[str, Any] = dict(ge=1e6, le=1e17)  # 1 MFLOP/s .. 100 PFLOP/s
BANDWIDTH: dict[str, Any] = dict(ge=1e3, le=1e12)  # 1 kB/s .. 8 Tbit/s


def plausible_bandwidth(measured: float) -> float:
    """A measurement within BANDWIDTH: a probe over loopback can finish faster than the clock resolves."""
    return min(max(measured, BANDWIDTH["ge"]), BANDWIDTH["le"])
LATENCY: dict[str, Any] = dict(ge=0, le=60)  # seconds, round trip
ADDRESS = r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}$"


class Offered(_Measured):
    """The files a node offers to jobs by name (`--dataset`, `--model-file`, `--offers`), each with its
    fingerprint; sent at join, and again whenever the volunteer changes them (PUT /v1/nodes/{id}/offers)."""
    datasets: list[Annotated[str, Field(pattern=DATASET_NAME)]] = Field(
        default_factory=list, max_length=64,
        description="names of the files this volunteer offers to jobs (`--dataset NAME=PATH`)")
    fingerprints: dict[Annotated[str, Field(pattern=DATASET_NAME)], Annotated[str, Field(pattern=FINGERPRINT)]] = \
        Field(default_factory=dict, max_length=64, description="each offered file's '<size>:<sha256>'; a node "
                                                               "is placed on a file only once it proved it holds it")

    @field_validator("datasets")
    @classmethod
    def _each_name_once(cls, names: list[str]) -> list[str]:
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"each file is offered under one name once; offered twice: {', '.join(twice[:5])}")
        return names


class NodeProfile(Offered):
    """What a node measured about itself when it joined, and what it offers."""
    flops: float = Field(description="matmul FLOP/s on the chosen device", **FLOPS)
    memory_bytes: int = Field(ge=1 << 20, le=1 << 46, description="memory free for training on the chosen device")
    device: str = Field("cpu", pattern=r"^(cpu|mps|cuda(:[0-9]{1,3})?)$", description="'cpu' or 'cuda[:i]'")
    gpu_name: str = Field("", max_length=128)
    cores: int = Field(1, ge=1, le=4096)
    bandwidth_bytes_per_s: float = Field(description="measured to the coordinator", **BANDWIDTH)
    latency_s: float = Field(description="round trip to the coordinator", **LATENCY)
    idle_bytes: int = Field(0, ge=0, le=1 << 46, description=(
        "the node process's own resident memory when it joined (torch and the node, about 0.5 GB on a CPU), "
        "on top of memory_bytes, which is for training only"))


class JoinRequest(_Strict):
    name: str = Field("", max_length=128)
    address: str = Field(pattern=ADDRESS, description="host:port (or [v6]:port) where this node's gRPC server "
                                                      "listens; no other live node may hold it")
    profile: NodeProfile
    identity: str = Field("", pattern=r"^([0-9a-f]{64})?$", description=(
        "the secret in this node's identity file (64 hex digits): a node that joins again with it keeps its "
        "id, row and history; empty: a new node"))
    relay_port: int | None = Field(None, ge=1, le=65535, description=(
        "this node relays for nodes that peers cannot dial (ravnest/relay), at this port of its address's host"))
    peer_relay_port: int | None = Field(None, ge=1, le=65535, description=(
        "at this port of its address's host, this node's peers in a job that nobody can dial listen for what it "
        "sends them (a relay for its own peers only: it dials them there itself)"))

    @field_validator("address")
    @classmethod
    def _port(cls, address: str) -> str:
        if not 1 <= int(address.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"port of {address!r} is outside 1..65535")
        return address


class JoinResponse(_Strict):
    node_id: str
    node_token: str = Field(description="credential for this node's later calls")
    heartbeat_interval_s: float
    probe_token: str = Field("", description="peers' Ping calls carry it (link probes, never data streams)")
    relay_secret: str = Field("", description="a relaying node's: what the tokens of the nodes it may relay for "
                                              "derive from (the coordinator hands them out)")


class LinkReport(_Measured):
    """What a node measured of its link to a peer (a gRPC Ping probe)."""
    peer_id: str = Field(max_length=64)
    bandwidth_bytes_per_s: float = Field(**BANDWIDTH)
    latency_s: float = Field(description="round trip", **LATENCY)


class PeerProbe(_Strict):
    """A peer the coordinator asks a node to measure its link to."""
    node_id: str
    address: str
    tls_name: str | None = Field(None, max_length=255, description="as StagePeer's")


class DataChallenge(_Strict):
    """Prove you hold the file offered as `dataset` (ravnest/data/proof.py)."""
    dataset: str = Field(pattern=DATASET_NAME)
    nonce: str = Field(pattern=HEX_NONCE)
    ranges: list[Annotated[tuple[Annotated[int, Field(ge=0, le=1 << 50)], Annotated[int, Field(ge=1, le=1 << 12)]],
                           Field(strict=False)]] = Field(max_length=8, description="(offset, length) byte ranges")


class DataProof(_Strict):
    dataset: str = Field(pattern=DATASET_NAME)
    nonce: str = Field(pattern=HEX_NONCE)
    answer: str = Field(pattern=SHA256)


class HeartbeatRequest(_Strict):
    job_id: str | None = Field(None, description="the job this node is running, if any")
    links: list[LinkReport] = Field(default_factory=list, max_length=64,
                                    description="links measured since the last heartbeat")
    training_alone: bool = Field(False, description="the job's stage trains on without its averaging (the "
                                                    "averaging failed, or the coordinator said `train_alone`)")
    proofs: list[DataProof] = Field(default_factory=list, max_length=64,
                                    description="answers to the challenges of the last heartbeat's reply")
    unreached: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=64, description="peers its link probes could not dial since the last beat")
    flops: float | None = Field(None, description="matmul FLOP/s measured again while idle (its profile's figure "
                                                  "was measured once, at join)", **FLOPS)
    address: str | None = Field(None, pattern=ADDRESS, description=(
        "where peers dial this node now, if not where it joined: its port on a relay (`relay` in the reply)"))


class HeartbeatResponse(_Strict):
    assignment: StageAssignment | None = None
    cancel_job: str | None = Field(None, description="stop working on this job")
    recover_job: str | None = Field(None, description="stop this job's current run and hand in the stage's "
                                                      "state: the job is being re-planned")
    train_alone: str | None = Field(None, description="this job is being re-planned around a loss elsewhere: "
                                                      "leave its averaging and keep training until `recover_job`")
    probe: list[PeerProbe] = Field(default_factory=list, description="measure the link to these peers and "
                                                                     "report it with a later heartbeat")
    note: str = Field("", description="why this idle node got no stage when a job was last placed")
    challenges: list[DataChallenge] = Field(default_factory=list, description="prove you hold these offered files: "
                                                                             "answer with the next heartbeat")
    reachable: bool | None = Field(None, description="whether this node's address could be dialled (by the "
                                                     "coordinator after it joined, or by a peer); None: not known yet")
    reachability: str = Field("", description="how that was found, in words")
    relay: RelayOffer | None = Field(None, description="peers cannot dial this node: listen on this relay and send "
                                                       "the address it gives with the next heartbeats")


class MetricsReport(_Strict):
    node_id: str = Field(max_length=64)
    cluster: int = Field(ge=0, le=100_000)
    stage: int = Field(ge=0, le=100_000)
    step: int = Field(ge=0, le=MAX_STEPS)
    metrics: dict[Annotated[str, Field(max_length=64)], float] = Field(
        max_length=MAX_FIGURES, description=f"the stage's figures (ravnest/telemetry.py), at most {MAX_FIGURES}; "
                                            "unknown names are dropped")


class FailureReport(_Strict):
    node_id: str
    reason: str = Field(max_length=2000)
    recoverable: bool = Field(False, description="the stage failed while training (e.g. it lost a peer), so "
                                                 "a re-plan may fix it; False: it could not start at all")
    still_training: bool = Field(False, description="the stage trains on alone: its averaging failed")
    failure: Failure | None = Field(None, description="the failure as data (ravnest/failures.py); nodes before it "
                                                      "sent only `reason`")


def field_names(model: type[BaseModel], path: list[str | int]) -> list[str]:
    """The field names of the model found at `path` inside `model` (e.g. ["training"] in a JobSpec:
    steps, batch_size, ...), or [] where the path leads to no model: for "did you mean" on a typo."""
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        inner = field and next((t for t in (field.annotation, *typing.get_args(field.annotation))
                                if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if not inner:
            return []
        model = inner
    return list(model.model_fields)
