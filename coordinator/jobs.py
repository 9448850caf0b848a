"""Job lifecycle: the state machine, validating a submitted spec, and what a job looks like from
outside (progress, metrics, each node's stage assignment).

    pending ──► placing ──► running ──► completed
     ▲ │           │ │         │ │
     │ │           │ └─► recovering ◄┘
     │ │           │         │ (re-planned: back to pending, one generation later)
     │ └───────────┴─────────┴──► failed | cancelled ──(resume)──► pending

pending: waiting for `placement.min_nodes` idle live nodes. placing: planned, nodes reserved, not
every node has fetched its assignment yet. running: every node has it. recovering: a node was lost or
a stage failed while training; the survivors stop and hand in their state, then the job is planned
again on whatever nodes are there and continues from the freshest state of every block. Each change
is kept in the job's history with its time and reason.
"""
from __future__ import annotations

import copy
import logging
import math
from collections import OrderedDict
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

import torch

from ravnest.averaging.registry import NO_AVERAGING
from ravnest.averaging.strategy import AUTO
from ravnest.data.datasets import DatasetError, load_dataset
from ravnest.models import ModelError, ModelSpec, build_model
from ravnest.pipeline.optim import build_optimizer
from ravnest.spec import AUTO_CODEC, AveragingSettings, JobSpec, Ring, StageAssignment, StagePeer, TrainingSettings

from .codec_choice import lossier_than
from .service_errors import Conflict, InvalidRequest
from .schemas import ClusterProgress, JobMetrics, Plan, PlannedCluster, PlannedStage, Progress, StageMetrics
from .store import JobRow, StageRow

if TYPE_CHECKING:
    from .service.reachability import DirectLinks

log = logging.getLogger(__name__)


class JobState(str, Enum):
    PENDING = "pending"
    PLACING = "placing"
    RUNNING = "running"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE = {JobState.PLACING.value, JobState.RUNNING.value}  # nodes are working on it
TERMINAL = {JobState.COMPLETED.value, JobState.FAILED.value, JobState.CANCELLED.value}
STOPPED = {JobState.FAILED.value, JobState.CANCELLED.value}  # its nodes must be told to stop
_NEXT = {
    JobState.PENDING: {JobState.PLACING, JobState.FAILED, JobState.CANCELLED},
    JobState.PLACING: {JobState.RUNNING, JobState.RECOVERING, JobState.FAILED, JobState.CANCELLED},
    JobState.RUNNING: {JobState.COMPLETED, JobState.RECOVERING, JobState.FAILED, JobState.CANCELLED},
    JobState.RECOVERING: {JobState.PENDING, JobState.FAILED, JobState.CANCELLED},
    JobState.FAILED: {JobState.PENDING},  # resumed from its last checkpoint
    JobState.CANCELLED: {JobState.PENDING},
}
TASK_OF_DATASET = {"digits": "classify", "npz": "classify", "text": "lm", "tokens": "lm"}


def transition(job: JobRow, state: JobState, reason: str, now: float) -> None:
    """Move `job` to `state`, recording when and why; Conflict if the state machine forbids it."""
    current = JobState(job.state)
    if state not in _NEXT.get(current, set()):
        raise Conflict(f"job {job.id} is {current.value}; it cannot become {state.value}")
    job.state, job.reason, job.updated_at = state.value, reason, now
    job.history = [*job.history, {"state": state.value, "at": now, "reason": reason}]
    log.info("job %s (%s): %s -> %s: %s", job.id, job.name, current.value, state.value, reason)


def validate_spec(spec: JobSpec, max_blocks: int) -> ModelSpec:
    """Everything about a job that can be checked before any node sees it; InvalidRequest if wrong.
    Nothing here allocates weights: the model is only described (shapes come from the meta device),
    and a model with more than `max_blocks` blocks is refused before a single one is built."""
    try:
        model = build_model(spec.model.name, spec.model.config)
    except ModelError as e:
        raise InvalidRequest(f"model: {e}") from e
    if model.num_blocks > max_blocks:
        raise InvalidRequest(f"model {spec.model.name!r} has {model.num_blocks:,} blocks; this coordinator plans "
                             f"at most {max_blocks:,} (its max_blocks limit)")
    deepest = model.stages_at_most
    if deepest is not None and (spec.placement.stages_per_cluster or 1) > deepest:
        raise InvalidRequest(f"model {spec.model.name!r} ties its first and last blocks' weights (tied embeddings), so "
                             f"a pipeline has {deepest} stage at most, not placement.stages_per_cluster = "
                             f"{spec.placement.stages_per_cluster}: set it to {deepest}, or untie them")
    codec = spec.training.codec
    if model.exact_links and codec not in ("", AUTO_CODEC) and lossier_than(codec, "bf16"):
        raise InvalidRequest(f"training.codec {codec!r} would round the token ids a residual_rank model sends "
                             f"between its stages; they arrive exactly only in float32 or bf16: use 'bf16' or 'auto'")
    dataset = spec.dataset
    if TASK_OF_DATASET[dataset.name] != model.task:
        raise InvalidRequest(f"dataset {dataset.name!r} needs a {TASK_OF_DATASET[dataset.name]!r} model; "
                             f"{spec.model.name!r} is a {model.task!r} model")
    if dataset.name != "digits" and not dataset.source:
        raise InvalidRequest(f"dataset {dataset.name!r} needs a source: the name volunteers offer its file under "
                             f"(`ravnest-node join --dataset NAME=PATH`)")
    # the text file lives on the nodes, so whether its bytes fit 128 ids or need 256 is checked there
    if dataset.name == "text" and (model.input.high or 0) > 256:
        raise InvalidRequest(f"dataset 'text' is a file's bytes, 256 ids at most, but the model's vocab_size is "
                             f"{model.input.high}: set it to 256 (128 for ASCII text), or tokenize the text into a "
                             f"token file with `ravnest data prepare` and use dataset 'tokens'")
    longest = model.input.shape[0]  # an lm's tokens per sequence: gpt's seq_len, llama's max_position_embeddings
    if dataset.name in ("text", "tokens") and dataset.seq_len > longest:
        raise InvalidRequest(f"dataset seq_len {dataset.seq_len} exceeds the {longest} tokens the model takes")
    if dataset.name == "digits":
        _check_accepts_digits(model, spec)
    _check_optimizer(spec)
    placement = spec.placement
    min_nodes = placement.min_nodes or 1  # (the spec sets it from the shape when not given)
    if placement.max_nodes is not None and placement.max_nodes < min_nodes:
        raise InvalidRequest(f"placement.max_nodes ({placement.max_nodes}) is below placement.min_nodes "
                             f"({placement.min_nodes})")
    if isinstance(placement.clusters, int):
        if min_nodes < placement.clusters:
            raise InvalidRequest(f"placement.min_nodes ({placement.min_nodes}) must be at least "
                                 f"placement.clusters ({placement.clusters}): each cluster needs a node")
        if spec.averaging.robust and placement.clusters < 3:
            raise InvalidRequest(f"averaging.robust compares the clusters' replicas, and of "
                                 f"{placement.clusters} nobody can tell which one lies: set placement.clusters to "
                                 f"3 or more (or 'auto'), or leave averaging.robust out")
    return model


def _check_accepts_digits(model: ModelSpec, spec: JobSpec) -> None:
    """digits ships with scikit-learn, so the coordinator passes a batch of its shape through the
    model on the meta device (shapes only, no weights)."""
    try:
        data = load_dataset(spec.dataset)
        with torch.no_grad():
            output = model.blocks(device="meta")(data.train_x[:2].to("meta"))
    except (DatasetError, RuntimeError, ValueError, ModelError) as e:
        raise InvalidRequest(f"model {spec.model.name!r} does not accept digits images (1x8x8): {e}") from e
    if output.shape != (2, output.shape[-1]) or output.shape[-1] < (data.num_classes or 0):
        raise InvalidRequest(f"model {spec.model.name!r} outputs shape {tuple(output.shape)} for 2 digits; "
                             f"it needs [2, >= {data.num_classes}] class scores")


def _check_optimizer(spec: JobSpec) -> None:
    try:  # built as a node builds it, on one dummy parameter: the name and the kwargs must be accepted
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], spec.training.optimizer)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e


SPECS_KEPT = 4096  # parsed job specs kept per process (a few KB each)
_specs: OrderedDict[str, JobSpec] = OrderedDict()


def spec_of(job: JobRow) -> JobSpec:
    """The job's spec, typed: parsed once per process, since a spec never changes once submitted but
    for `pin_content` (the store keeps the JSON; a restarted coordinator parses it again)."""
    spec = _specs.get(job.id)
    if spec is None:
        spec = _specs[job.id] = JobSpec.model_validate(job.spec)
        if len(_specs) > SPECS_KEPT:
            _specs.popitem(last=False)
    return spec


def pin_content(job: JobRow, contents: dict[str, str]) -> None:
    """The job reads the files with these contents (field, e.g. "model.weights" -> sha256) from now on,
    whoever offers their names later."""
    spec = copy.deepcopy(job.spec)
    for field, sha256 in contents.items():
        part = spec
        for key in field.split("."):
            part = part[key]
        part["sha256"] = sha256
    if spec != job.spec:
        job.spec = spec
        _specs.pop(job.id, None)


def assignment(job: JobRow, plan: Plan, cluster: int, stage: int, token: str,
               peer_credentials: dict[str, str], tls_names: dict[str, str],
               direct: DirectLinks | None = None, audit_secret: int | None = None,
               signing_key: Callable[[str], str] | None = None) -> StageAssignment:
    """What the node running `stage` of `cluster` needs to know, rings and credentials included
    (`tls_names`: node id -> the name its certificate carries, for those reached through a relay;
    `direct`: the links that a side nobody can dial opened itself, at the other side's relay for peers;
    where the job's averaging is robust, `audit_secret`: stage 0's, and `signing_key`: node id -> the
    public key its robust rounds' commitments are signed with)."""
    spec = spec_of(job)
    stages = plan.clusters[cluster].stages
    me = stages[stage].node_id
    signs = signing_key if spec.averaging.robust else None

    def member(node: PlannedStage, codec: str | None = None, ring: bool = False) -> StagePeer:
        return StagePeer(node_id=node.node_id, address=node.address, codec=codec, tls_name=tls_names.get(node.node_id),
                         listen_at=direct.listen_at(me, node.node_id) if direct else None,
                         dials_out=direct.dials_out(me, node.node_id) if direct else False,
                         signing_key=signs(node.node_id) if signs and ring else None,
                         starts_at=node.blocks[0] if ring else None)

    def peer(s: int, link: int) -> StagePeer:  # link: the stage whose link to the next one joins the two
        return member(stages[s], stages[link].codec)
    rings = [] if spec.averaging.strategy == NO_AVERAGING else [
        Ring(segment=ring.segment, blocks=ring.blocks, weights=ring.weights, order=ring.order,
             members=[member(plan.clusters[c].stages[s], ring=True) for c, s in enumerate(ring.stages)])
        for ring in plan.rings if ring.stages[cluster] == stage]
    planned = stages[stage]
    return StageAssignment(
        job_id=job.id, generation=job.generation, resume_step=(job.resume or {}).get("step", 0),
        checkpoint_every=spec.checkpoints.every if cluster == 0 else 0,
        checkpoint_every_s=spec.checkpoints.every_seconds if cluster == 0 else None, token=token,
        peer_credentials=peer_credentials, cluster=cluster,
        num_clusters=len(plan.clusters), stage=stage, num_stages=len(stages), blocks=planned.blocks,
        input_shape=planned.input_shape, input_dtype=planned.input_dtype,
        predicted_memory_bytes=planned.predicted_memory_bytes, split_backward=planned.split_backward,
        model=spec.model, dataset=spec.dataset,
        training=_training(spec, plan.clusters[cluster]), averaging=_averaging(spec, plan),
        prev=peer(stage - 1, stage - 1) if stage > 0 else None,
        next=peer(stage + 1, stage) if stage + 1 < len(stages) else None,
        rings=rings, audit_secret=audit_secret if stage == 0 and spec.averaging.robust else None)



def _training(spec: JobSpec, cluster: PlannedCluster) -> TrainingSettings:
    """The job's training, with the K the planner chose for its links' round trips where it chose none."""
    if spec.training.microbatches_in_flight is not None or cluster.in_flight in (None, len(cluster.stages)):
        return spec.training
    return spec.training.model_copy(update={"microbatches_in_flight": cluster.in_flight})

def planned_peers(plan: Plan, cluster: int, stage: int) -> set[str]:
    """The nodes `stage` of `cluster` exchanges values with: its pipeline neighbours and its rings' members
    (as its assignment names them), itself excluded."""
    stages = plan.clusters[cluster].stages
    neighbours = {stages[s].node_id for s in (stage - 1, stage + 1) if 0 <= s < len(stages)}
    members = {plan.clusters[c].stages[s].node_id for ring in plan.rings if ring.stages[cluster] == stage
               for c, s in enumerate(ring.stages)}
    return (neighbours | members) - {stages[stage].node_id}


def _averaging(spec: JobSpec, plan: Plan) -> AveragingSettings:
    """The job's averaging settings, with the planner's strategy (and topology) where it asked for "auto"
    and its pacing where the job left it open."""
    if plan.averaging is None:
        return spec.averaging
    update: dict[str, Any] = {}
    if spec.averaging.strategy == AUTO:
        update = {"strategy": plan.averaging.strategy, "topology": plan.averaging.topology or spec.averaging.topology}
    if spec.averaging.paced is None:
        update["paced"] = plan.averaging.paced
    if spec.averaging.codec == AUTO_CODEC:
        update["codec"] = plan.averaging.codec
    return spec.averaging.model_copy(update=update)


def progress(job: JobRow, stages: list[StageRow]) -> Progress:
    total = spec_of(job).training.steps
    by_cluster: dict[int, list[int]] = {}
    for row in stages:
        by_cluster.setdefault(row.cluster, []).append(row.step)
    clusters = [ClusterProgress(cluster=c, steps_done=min(steps), stage_steps=steps)
                for c, steps in sorted(by_cluster.items())]
    if job.state == JobState.COMPLETED.value:
        fraction = 1.0
    elif clusters:
        fraction = min(1.0, sum(c.steps_done for c in clusters) / (len(clusters) * total))
    else:  # not placed (yet, or again: a re-planned job continues from its resume step)
        fraction = (job.resume or {}).get("step", 0) / total
    return Progress(steps_total=total, fraction=fraction, clusters=clusters)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def metrics(stages: list[StageRow], plan: Plan | None = None) -> JobMetrics:
    """Live figures: the loss and throughput seen by each cluster's last stage, utilization of all."""
    last: dict[int, StageRow] = {}
    for row in stages:
        if row.cluster not in last or row.stage > last[row.cluster].stage:
            last[row.cluster] = row
    tails = [last[c].metrics for c in sorted(last)]
    throughput = [m["samples_per_s"] for m in tails if "samples_per_s" in m]
    tokens = [m["tokens_per_s"] for m in tails if "tokens_per_s" in m]
    averaging = [row.metrics for row in stages if "avg_rounds" in row.metrics]
    return JobMetrics(
        loss=_mean([m["loss"] for m in tails if "loss" in m]),
        samples_per_s=sum(throughput) if throughput else None,
        tokens_per_s=sum(tokens) if tokens else None, mfu=_mfu([row.metrics for row in stages]),
        utilization=_mean([row.metrics["utilization"] for row in stages if "utilization" in row.metrics]),
        bubble=_mean([row.metrics["bubble"] for row in stages if "bubble" in row.metrics]),
        staleness=_mean([row.metrics["staleness"] for row in stages if "staleness" in row.metrics]),
        test_accuracy=tails[0].get("test_accuracy") if tails else None,
        test_loss=tails[0].get("test_loss") if tails else None,
        averaging_rounds=min((m["avg_rounds"] for m in averaging), default=None),
        averaging_round_s=_mean([m["avg_round_s"] for m in averaging if "avg_round_s" in m]),
        averaging_stall_fraction=max((m.get("avg_stall_s", 0.0) / m["elapsed_s"] for m in averaging
                                      if m.get("elapsed_s", 0) > 0), default=None),
        step_s=max((m["elapsed_s"] / m["step"] for m in (row.metrics for row in stages)
                    if m.get("step", 0) > 0 and "elapsed_s" in m), default=None),
        stages=[StageMetrics(cluster=row.cluster, stage=row.stage, node_id=row.node_id, step=row.step,
                             metrics=row.metrics, weights_uploaded=row.weights_uploaded,
                             predicted_memory_bytes=_predicted_memory(plan, row),
                             peak_memory_bytes=row.metrics.get("memory_peak_bytes"),
                             utilization=row.metrics.get("utilization"), bubble=row.metrics.get("bubble"),
                             staleness=row.metrics.get("staleness"))
                for row in stages])


def _mfu(figures: list[dict[str, float]]) -> float | None:
    """All stages' model FLOPs per second over the sum of their peaks (each stage's is its figures'
    model_flops_per_s / mfu); None unless every stage reported one."""
    if not figures or not all(m.get("mfu", 0) > 0 and "model_flops_per_s" in m for m in figures):
        return None
    return sum(m["model_flops_per_s"] for m in figures) / sum(m["model_flops_per_s"] / m["mfu"] for m in figures)


def _predicted_memory(plan: Plan | None, row: StageRow) -> int | None:
    return plan.clusters[row.cluster].stages[row.stage].predicted_memory_bytes if plan else None


def check_finite(values: dict[str, float]) -> None:
    bad = sorted(key for key, value in values.items() if not math.isfinite(value))
    if bad:
        raise InvalidRequest(f"metrics must be finite numbers; not finite: {bad}")
