"""What a node is told to run: its stage of a plan, its peers, its rings."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from .common import BlockRange, Strict
from .job import AveragingSettings, DatasetRef, ModelRef, TrainingSettings, known_codec


class RelayOffer(Strict):
    """A relay (ravnest/relay) this node may listen on: peers could not dial it directly."""
    address: str = Field(max_length=300, description=(
        "host:port of the relay; no host (':8471') means the coordinator's own host, as this node reaches it"))
    token: str = Field(max_length=128, description="shows the relay that the coordinator sent this node")


class StagePeer(Strict):
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
    signing_key: str | None = Field(None, pattern="^[0-9a-f]{64}$", description=(
        "ring members only: the Ed25519 public key (hex) it signs its robust rounds' commitments with "
        "(ravnest/averaging/signatures.py)"))
    starts_at: int | None = Field(None, ge=0, description=(
        "ring members only: the first block of its stage; audits compare stages that start at the same block "
        "(ravnest/pipeline/audits.py). None: not said"))

    @field_validator("codec")
    @classmethod
    def _pipeline_codec(cls, name: str | None) -> str | None:
        return name if name is None else known_codec(name, "pipeline")


class Ring(Strict):
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


class StageAssignment(Strict):
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
    audit_secret: int | None = Field(
        None, ge=0, lt=2 ** 63, description="stage 0 only, where audits run: what every cluster's stage 0 draws the "
                                            "place and key of its audits from (ravnest/pipeline/audits.py); "
                                            "secret from the other stages")
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

    @property
    def is_first(self) -> bool:
        """Stage 0: it feeds the pipeline its data."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """It computes the loss."""
        return self.stage == self.num_stages - 1

    def tls_names(self) -> dict[str, str]:
        """address -> the name its certificate carries, for the peers this stage dials at a relay."""
        return {p.address: p.tls_name for p in self.peers() if p.tls_name}
