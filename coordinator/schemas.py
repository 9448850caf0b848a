"""Bodies of the coordinator's own REST responses (the node contract lives in ravnest.spec)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ravnest.failures import Failure
from ravnest.spec import JobSpec, LinkReport, NodeProfile


class ErrorBody(BaseModel):
    """Every refusal (4xx): the reason, in words."""
    detail: str


class Health(BaseModel):
    status: str = "ok"
    nodes_alive: int
    jobs_active: int


class NodeView(BaseModel):
    id: str
    name: str
    address: str
    profile: NodeProfile
    state: str = Field(description="idle | busy | gone")
    joined_at: float
    last_seen: float
    job_id: str | None = None
    cluster: int | None = None
    stage: int | None = None
    links: list[LinkReport] = Field(default_factory=list, description="links this node measured to peers")
    note: str = Field("", description="why this node got no stage when a job was last placed, if it got none; "
                                      "why it is quarantined, if it is")
    offers: dict[str, str] = Field(default_factory=dict, description="each file it offers -> first (the first to "
                                                                     "offer that content), challenged, proven, or "
                                                                     "refused with why")
    quarantined_until: float | None = Field(None, description="its failure reports caused too many re-plans: it is "
                                                              "not placed (nor believed) until then")
    accused_by: list[str] = Field(default_factory=list, description="nodes that refused values it sent (not finite, "
                                  "or an outlier) within the quarantine window: one is a claim, two convict it")
    measured_flops: float | None = Field(None, description="FLOP/s its stages measured, where that was far below "
                                                           "its profile's claim: the planner's figure since")
    measured_bandwidth: float | None = Field(None, description="bytes/s its peers measured of its links, where that "
                                                               "was far below its profile's claim: the planner's "
                                                               "figure since")
    slowdown: float | None = Field(None, description="its stages' compute seconds as measured over as its FLOP/s "
                                                     "predict, recent jobs weighing most; the planner counts its "
                                                     "FLOP/s divided by this (None: no job measured yet)")
    by_model: dict[str, dict[str, float]] = Field(default_factory=dict, description=(
        "its slowdown and message cost on each model it trained: a job of one of these is planned with those"))
    message_s: float | None = Field(None, description="seconds one message between its stage and a neighbour "
                                                      "costs beyond bytes over the link and latency, as its "
                                                      "jobs' pace measured (None: no job measured yet)")
    reachable: bool | None = Field(None, description="whether its address could be dialled, by the coordinator "
                                                     "after it joined or by a peer's link probe; None: not known yet")
    reachability: str = Field("", description="how that was found, in words")
    relay_port: int | None = Field(None, description="it relays for nodes peers cannot dial, on this port")
    relayed_by: str | None = Field(None, description="peers cannot dial it directly: the relay it was given, a "
                                                     "node's id or 'coordinator' (the coordinator's own)")


class PlannedStage(BaseModel):
    stage: int
    node_id: str
    address: str
    blocks: tuple[int, int]
    predicted_seconds: float = Field(description="predicted seconds per micro-batch (forward+backward+transfer)")
    predicted_compute_seconds: float | None = Field(None, description=(
        "the forward and backward alone: what the stage's `compute_s` measures (its node's slowdown included)"))
    predicted_message_seconds: float | None = Field(None, description=(
        "what the plan counted per message to or from its node beyond bytes and latency (two per micro-batch)"))
    predicted_memory_bytes: int = Field(0, description="memory the stage is predicted to hold (weights, gradients, "
                                                       "optimizer state, weight versions, activations, buffers)")
    input_shape: list[int] | None = Field(None, description="activations it receives per micro-batch; None on stage 0")
    input_dtype: str = "float32"
    split_backward: bool = Field(True, description="the backward is split into input and weight halves "
                                                   "(zero-bubble); off where memory does not allow it")
    codec: str | None = Field(None, description="the codec on its link to the next stage, both ways; None on the "
                                                "last stage ('' sends float32 as computed)")
    predicted_link_bytes_per_step: int | None = Field(None, description=(
        "bytes its link to the next stage carries per optimizer step, activations and gradients, as coded"))
    link_bandwidth_bytes_per_s: float | None = Field(None, description=(
        "the bandwidth of its link to the next stage that the plan priced (None on the last stage)"))
    round_trip_seconds: float | None = Field(None, description=(
        "the round trip of its link to the next stage, as probed (None on the last stage): in no stage's time, "
        "its cluster's micro-batches in flight cover it"))


class PlannedCluster(BaseModel):
    cluster: int
    stages: list[PlannedStage]
    predicted_bottleneck_seconds: float
    in_flight: int | None = Field(None, description="K, the micro-batches its stages keep in flight: the job's, "
                                                    "or the planner's for the links' round trips")


class PlannedRing(BaseModel):
    segment: int
    blocks: tuple[int, int]
    stages: list[int] = Field(description="the stage holding this segment, per cluster")
    members: list[str] = Field(description="node ids holding this segment, per cluster")
    weights: list[float] | None = Field(None, description="share of the segment each member reduces, in ring "
                                                          "order (balanced against bandwidth); None: equal")
    order: list[int] | None = Field(None, description="clusters in the order the all-reduce passes shares around, "
                                                      "chosen for the widest slowest measured link; None: 0..n-1")


class PlannedAveraging(BaseModel):
    strategy: str = Field(description="the strategy the clusters run: the job's, or the planner's pick for 'auto'")
    topology: str = Field("", description="its topology, for gossip strategies")
    paced: bool = Field(False, description="gossip rounds paced by the receivers: a segment takes longer on the "
                                           "slowest link than a step's compute")
    codec: str = Field("", description="the codec replicas send with: the job's, or the planner's pick for 'auto'")
    compute_step_s: float = Field(description="predicted compute seconds per optimizer step, slowest cluster")
    predicted_step_s: dict[str, float] = Field(
        description="runtime model (ravnest/averaging/runtime.py): seconds per optimizer step under each "
                    "strategy ('dadam:ring' = dadam on the ring topology; 'allreduce' = bucketed all-reduce "
                    "after the backward, for reference); compare with metrics.step_s")


class Plan(BaseModel):
    clusters: list[PlannedCluster]
    rings: list[PlannedRing]
    averaging: PlannedAveraging | None = Field(None, description="None with one cluster or no averaging")
    unused: dict[str, str] = Field(default_factory=dict, description="node id -> why it got no stage")
    predicted_samples_per_s: float
    reason: str = Field("", description="why the job has this shape (clusters x stages), with the alternatives")


class StateChange(BaseModel):
    state: str
    at: float
    reason: str = ""


class ClusterProgress(BaseModel):
    cluster: int
    steps_done: int = Field(description="steps completed by the slowest stage of this cluster")
    stage_steps: list[int]


class Progress(BaseModel):
    steps_total: int
    fraction: float
    clusters: list[ClusterProgress] = Field(default_factory=list)


class StageMetrics(BaseModel):
    cluster: int
    stage: int
    node_id: str
    step: int
    metrics: dict[str, float]
    weights_uploaded: bool
    predicted_memory_bytes: int | None = Field(None, description="what the planner predicted this stage holds")
    peak_memory_bytes: float | None = Field(None, description="what the node measured: peak above idle "
                                                              "(RSS on CPU, allocated on CUDA)")
    utilization: float | None = Field(None, description="share of the stage's wall time spent computing")
    bubble: float | None = Field(None, description="share of the stage's wall time spent waiting (1 - utilization)")
    staleness: float | None = Field(None, description="mean optimizer steps between a micro-batch's forward and "
                                                      "its weight gradient on this stage (0 = synchronous)")


class JobMetrics(BaseModel):
    loss: float | None = Field(None, description="mean of the clusters' last-stage training loss")
    samples_per_s: float | None = Field(None, description="sum over clusters (last stage)")
    tokens_per_s: float | None = Field(None, description="a language model's training tokens per second, sum over "
                                                         "clusters")
    mfu: float | None = Field(None, description="model FLOPs utilization: all stages' model FLOPs per second over "
                                                "their GPUs' 16-bit peaks (only where every stage knows its peak)")
    utilization: float | None = Field(None, description="mean over all stages")
    bubble: float | None = Field(None, description="mean over all stages of the share of time spent waiting")
    staleness: float | None = Field(None, description="mean over all stages of the optimizer steps between a "
                                                      "micro-batch's forward and its weight gradient")
    test_accuracy: float | None = Field(None, description="cluster 0's last stage, when evaluated")
    test_loss: float | None = Field(None, description="cluster 0's last stage, when evaluated (a language model's "
                                                      "perplexity is its exp)")
    averaging_rounds: float | None = Field(None, description="averaging rounds applied, fewest over the "
                                                             "stages that average")
    averaging_round_s: float | None = Field(None, description="mean seconds per round, over those stages")
    averaging_stall_fraction: float | None = Field(
        None, description="largest share of a stage's time spent waiting on averaging; near 0 means the "
                          "pipeline kept running while rounds were in flight")
    step_s: float | None = Field(None, description="measured seconds per optimizer step, slowest cluster "
                                                   "(compare with plan.averaging.predicted_step_s)")
    stages: list[StageMetrics] = Field(default_factory=list)


class CurvePoint(BaseModel):
    id: int = Field(description="increasing: ask for the points after the last one seen")
    cluster: int
    step: int
    at: float
    loss: float | None = None
    test_accuracy: float | None = Field(None, description="set where the stage had just evaluated")
    test_loss: float | None = Field(None, description="set where the stage had just evaluated (a language "
                                                      "model's perplexity is its exp)")
    samples_per_s: float | None = None


class JobSummary(BaseModel):
    id: str
    name: str
    state: str
    reason: str
    model: str
    created_at: float
    updated_at: float


class Recovery(BaseModel):
    """One re-plan of a job: what was lost, where it continued from, how long training stood still."""
    kind: str = Field("lost", description="lost (a node or a stage), grow (new nodes help), resume (by request)")
    at: float = Field(description="when the loss was noticed")
    reason: str
    generation: int = Field(description="the generation (run) that was lost")
    reached_step: int = Field(description="the furthest step any stage of that run had reached")
    resume_step: int | None = Field(None, description="the step the next run continued from")
    steps_redone: int | None = Field(None, description="steps between resume_step and reached_step, trained again")
    sources: list[str] = Field(default_factory=list, description="where each block range's state came from")
    recovery_s: float | None = Field(None, description="seconds from the loss to training again")
    kept_training: list[int] = Field(default_factory=list, description="clusters that lost nothing and trained on "
                                                                    "(alone) while the job was re-planned")
    broken: list[int] = Field(default_factory=list, description="clusters a member of which said it stopped: "
                                                                "the re-plan does not wait for them to train alone")
    steps_trained_on: int | None = Field(None, description="steps the furthest state handed in is beyond the step "
                                                           "reached when the loss was noticed")
    hand_in_at: float | None = Field(None, description="when the nodes still training were told to stop and hand in "
                                                       "(after a loss: once the lost cluster was done)")
    failure: Failure | None = Field(None, description="what the node that reported the loss said, as data: its "
                                                      "kind, the peer it lost, the step, and the transport's detail")
    left_out: list[str] = Field(default_factory=list, description="nodes the job is no longer placed on (too slow, "
                                                                   "lost, or said to be by a failure report)")
    reported_by: str | None = Field(None, description="the node whose failure report caused it")
    could_not_start: bool = Field(False, description="the report said the stage could not start at all")
    released: list[str] = Field(default_factory=list, description="the nodes of the lost run, released for the "
                                                                  "re-plan: it waits a few of their beats for them")
    released_at: float | None = Field(None, description="when they were released")


class JobView(JobSummary):
    spec: JobSpec
    history: list[StateChange]
    generation: int = Field(0, description="re-plans so far: after a lost node, a failed stage or a resume")
    recoveries: list[Recovery] = Field(default_factory=list)
    checkpoint_step: int | None = Field(None, description="step of the latest complete checkpoint")
    progress: Progress
    metrics: JobMetrics
    final_metrics: dict[str, float] | None = None
    plan: Plan | None = None
    model_url: str | None = Field(None, description="download of the trained model once completed")


class JobCreated(BaseModel):
    id: str
    state: str
    reason: str = ""


# what an API key may do (auth.py says which calls need which): the one list of roles
Role = Literal["operator", "submitter", "reader"]
MAX_LIFETIME_S = 366 * 86400.0


class JoinTokenRequest(BaseModel):
    model_config = {"extra": "forbid", "strict": True}  # strict: `true` is not 1 second
    name: str = Field("", max_length=128, description="what it is for, e.g. 'lab machines, November'")
    expires_in_s: float | None = Field(None, gt=0, le=MAX_LIFETIME_S, description="seconds it stays valid; "
                                                                                   "None: until revoked")
    uses: int | None = Field(None, ge=1, le=1_000_000, description="joins it admits; None: unlimited")


class KeyRequest(BaseModel):
    model_config = {"extra": "forbid", "strict": True}
    name: str = Field("", max_length=128, description="whose key, e.g. 'alice'")
    role: Role = Field(description="operator: everything; submitter: submits jobs and sees, cancels, resumes and "
                                   "downloads its own; reader: sees every job and node, changes nothing")
    expires_in_s: float | None = Field(None, gt=0, le=MAX_LIFETIME_S)


class Identity(BaseModel):
    """Who the caller's API key is, and what it may do (the dashboard shows only what works)."""
    id: str
    role: Role
    name: str
    sees_every_job: bool
    may_submit: bool


class CredentialView(BaseModel):
    id: str
    kind: str = Field(description="join | key")
    role: str | None = None
    name: str
    created_at: float
    expires_at: float | None = None
    uses_left: int | None = Field(None, description="join tokens: joins left; None: unlimited")
    used: int = 0
    revoked_at: float | None = None


class CredentialCreated(CredentialView):
    token: str = Field(description="shown once: only its hash is kept")


class DashboardLink(BaseModel):
    path: str = Field(description="open the coordinator's URL with this path once: it logs in with your key")
    expires_in_s: float
