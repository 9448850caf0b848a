"""The node <-> coordinator REST bodies: joining, heartbeats, probes, proofs, reports."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator

from ravnest.failures import Failure
from ravnest.printable import Name, Prose
from ravnest.telemetry import MAX_FIGURES

from .assignment import RelayOffer, StageAssignment
from .common import DATASET_NAME, FINGERPRINT, HEX_NONCE, MAX_STEPS, SHA256, Strict


class _Measured(Strict):
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
SPREAD: dict[str, Any] = dict(ge=1.0, le=1e6)  # a repeated measurement's largest over its smallest
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
    vocab_sizes: dict[Annotated[str, Field(pattern=DATASET_NAME)], Annotated[int, Field(ge=1, le=1 << 32)]] = Field(
        default_factory=dict, max_length=64, description="each offered token file's vocabulary, as its header says "
                                                         "(`ravnest data prepare`): a job whose model has fewer ids "
                                                         "is refused at submit, not on the nodes")

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
    gpu_name: Name = Field("", max_length=128)
    cores: int = Field(1, ge=1, le=4096)
    bandwidth_bytes_per_s: float = Field(description="measured to the coordinator", **BANDWIDTH)
    latency_s: float = Field(description="round trip to the coordinator", **LATENCY)
    bandwidth_spread: float = Field(1.0, description="how far its repeated probes lay apart (largest over smallest)",
                                    **SPREAD)
    idle_bytes: int = Field(0, ge=0, le=1 << 46, description=(
        "the node process's own resident memory when it joined (torch and the node, about 0.5 GB on a CPU), "
        "on top of memory_bytes, which is for training only"))


class JoinRequest(Strict):
    name: Name = Field("", max_length=128)
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


class JoinResponse(Strict):
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
    spread: float = Field(1.0, description="how far its repeated probes lay apart (largest over smallest): a wide "
                                           "one is measured again", **SPREAD)


class PeerProbe(Strict):
    """A peer the coordinator asks a node to measure its link to."""
    node_id: str
    address: str
    tls_name: str | None = Field(None, max_length=255, description="as StagePeer's")


class DataChallenge(Strict):
    """Prove you hold the file offered as `dataset` (ravnest/data/proof.py)."""
    dataset: str = Field(pattern=DATASET_NAME)
    nonce: str = Field(pattern=HEX_NONCE)
    ranges: list[Annotated[tuple[Annotated[int, Field(ge=0, le=1 << 50)], Annotated[int, Field(ge=1, le=1 << 12)]],
                           Field(strict=False)]] = Field(max_length=8, description="(offset, length) byte ranges")


class DataProof(Strict):
    dataset: str = Field(pattern=DATASET_NAME)
    nonce: str = Field(pattern=HEX_NONCE)
    answer: str = Field(pattern=SHA256)


class HeartbeatRequest(Strict):
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


class HeartbeatResponse(Strict):
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
    heartbeat_interval_s: float | None = Field(None, description=(
        "beat every this many seconds from now on (it grows with the number of nodes); None: as before"))


class MetricsReport(Strict):
    node_id: str = Field(max_length=64)
    cluster: int = Field(ge=0, le=100_000)
    stage: int = Field(ge=0, le=100_000)
    step: int = Field(ge=0, le=MAX_STEPS)
    metrics: dict[Annotated[str, Field(max_length=64)], float] = Field(
        max_length=MAX_FIGURES, description=f"the stage's figures (ravnest/telemetry.py), at most {MAX_FIGURES}; "
                                            "unknown names are dropped")


class FailureReport(Strict):
    node_id: str
    reason: Prose = Field(max_length=2000)
    recoverable: bool = Field(False, description="the stage failed while training (e.g. it lost a peer), so "
                                                 "a re-plan may fix it; False: it could not start at all")
    still_training: bool = Field(False, description="the stage trains on alone: its averaging failed")
    failure: Failure | None = Field(None, description="the failure as data (ravnest/failures.py); nodes before it "
                                                      "sent only `reason`")
