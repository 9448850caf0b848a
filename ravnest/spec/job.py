"""The job a user submits: the model, the data, training, averaging, placement and checkpoints."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from ravnest.averaging.registry import AUTO, NO_AVERAGING, available_strategies, is_strategy, registered, strategy_info
from ravnest.errors import did_you_mean
from ravnest.printable import Name
from ravnest.wire import codecs

from .common import DATASET_NAME, MAX_STEPS, SHA256, Strict, plain_json

AUTO_CODEC = codecs.AUTO  # training.codec, averaging.codec: the planner picks


def known_codec(name: str, use: str) -> str:
    if name not in codecs.names(use):
        raise ValueError(f"{name[:32]!r} is not a codec for {'the pipeline' if use == 'pipeline' else use}"
                         f"{did_you_mean(name, codecs.names(use))}; choose one of "
                         f"{', '.join(repr(n) for n in codecs.names(use))}")
    return name




class StartingWeights(Strict):
    """Weights a job starts from (fine-tuning): a safetensors file volunteers offer, read by each stage
    for its own tensors only (ravnest/models/weights.py)."""
    source: str = Field(pattern=DATASET_NAME, description=(
        "the name volunteers offer the file under (`ravnest-node join --model-file NAME=PATH`): a Hugging Face "
        "checkpoint's model.safetensors (llama) or a `ravnest download`. The job runs only on nodes that proved "
        "they hold it"))
    sha256: str | None = Field(None, pattern=SHA256, description=(
        "the sha256 of the file's bytes (`ravnest-node join` prints it); unset, the coordinator pins the content "
        "most proven holders offer when the job is first placed"))


class ModelRef(Strict):
    name: str = Field(max_length=64, description="architecture in the registry, e.g. 'cnn', 'mlp', 'gpt'")
    config: dict[str, Any] = Field(default_factory=dict, description="JSON config for the builder")
    weights: StartingWeights | None = Field(None, description=(
        "start from these weights instead of the seed's random ones (fine-tuning)"))

    @field_validator("config")
    @classmethod
    def _small(cls, config: dict[str, Any]) -> dict[str, Any]:
        return plain_json(config, "model.config")


class DatasetRef(Strict):
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


class OptimizerRef(Strict):
    name: str = Field("Adam", max_length=64, description="any torch.optim class name, or AccumAdam / AccumAdamW "
                      "(Adam whose moments advance every `accumulation` steps: ravnest/pipeline/accum_adam.py)")
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-3})

    @field_validator("kwargs")
    @classmethod
    def _small(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return plain_json(kwargs, "optimizer.kwargs")


class TrainingSettings(Strict):
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
        "how activations and their gradients cross the wire: '' as computed, 'fp16', 'bf16', blockwise 'q8', "
        "'q4' or 'q3' (8, 4 or 3 bits a value and a scale per 64), 'q4g3' (q4 activations, q3 gradients), or "
        "'auto': the planner picks per link the least lossy one that keeps the link from slowing its stages, "
        "none lossier than measured for the model (ravnest/wire/codecs, docs/links.md)"))
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
        return name if name == AUTO_CODEC else known_codec(name, "pipeline")


class AveragingSettings(Strict):
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
    robust: Literal["", "centered_clip", "trimmed_mean", "median"] = Field(
        "", description="'': the plain mean. Else a mean that fewer than half of the replicas cannot move far "
                        "whatever they send, and a replica whose contributions most others find far beyond "
                        "theirs is left out of the job as an outlier: 'centered_clip' (recommended), "
                        "'trimmed_mean', 'median'. Needs 3 or more clusters; ring, diloco and dear; the gossip "
                        "strategies dsgd, dadam and ada clip each neighbour's difference instead, whatever the "
                        "rule. Also audits pipeline stages where 3 or more clusters cut the model alike "
                        "(docs/security.md)")

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
        return name if name == AUTO_CODEC else known_codec(name, "averaging")

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
        if self.robust and not strategy_info(self.strategy).robust:
            raise ValueError(f"averaging.robust is built for {', '.join(i.name for i in registered() if i.robust)}, "
                             f"not '{self.strategy}'")
        if self.robust and (self.backend == "torch" or (self.sent_codec and not codecs.codec(self.sent_codec).reduces)):
            raise ValueError("averaging.robust runs its own rounds over the peer wire: it takes backend 'grpc' and "
                             "a codec whose values add up ('', 'fp16', 'bf16', 'int8')")
        if self.every_seconds is not None and not strategy_info(self.strategy).by_seconds:
            raise ValueError(f"'{self.strategy}' averages by steps; `every_seconds` is for strategies that "
                             f"average by the clock: {', '.join(i.name for i in registered() if i.by_seconds)}")
        return self

    def of(self, strategy: str) -> Any:
        """Strategy `strategy`'s own settings model: what the job gave under its name, else its defaults."""
        return strategy_info(strategy).settings.model_validate((self.__pydantic_extra__ or {}).get(strategy, {}))


class Placement(Strict):
    clusters: Annotated[int, Field(ge=1, le=10_000)] | Literal["auto"] = "auto"
    min_nodes: PositiveInt | None = Field(None, le=100_000,
                                          description="wait in 'pending' until at least this many idle nodes "
                                                      "joined (default: what clusters x stages_per_cluster asks "
                                                      "for, as far as they are given; else 1)")
    timeout_s: float | None = Field(None, gt=0, le=366 * 86400,
                                    description="fail a job still pending after this many seconds "
                                                "(default: wait as long as it takes)")
    max_recoveries: int = Field(3, ge=0, le=1000,
                                description="re-plans after a lost node or a failed stage before the job fails; "
                                            "each tenth of the job's steps trained anew gives one back")
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


class CheckpointSettings(Strict):
    every: int = Field(100, ge=0, le=MAX_STEPS, description="optimizer steps between checkpoints of cluster 0's stages "
                                              "(parameters, optimizer state, step); 0 = none")
    every_seconds: float | None = Field(None, ge=1, le=86400,
                                        description="also checkpoint when this many seconds passed since the last "
                                                    "one (whichever of the two comes first); None = by steps only")


class JobSpec(Strict):
    name: Name = Field("", max_length=256)
    model: ModelRef
    dataset: DatasetRef
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    averaging: AveragingSettings = Field(default_factory=AveragingSettings)
    placement: Placement = Field(default_factory=Placement)
    checkpoints: CheckpointSettings = Field(default_factory=CheckpointSettings)
