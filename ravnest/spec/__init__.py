"""The contract between the coordinator and the nodes: what a job asks for and what a node is told.

Both sides import these pydantic models (`coordinator/` and `node/` never import each other).
Everything here is plain data: architecture names and configs, never code.

- `job`: the job a user submits (`JobSpec` and its parts);
- `assignment`: what a node is told to run (`StageAssignment`, its peers and rings);
- `protocol`: the node <-> coordinator REST bodies (join, heartbeat, reports);
- `common`: strict models, bounds and name patterns they share.
"""
from .assignment import RelayOffer, Ring, StageAssignment, StagePeer
from .common import DATASET_NAME, FINGERPRINT, HEX_NONCE, MAX_STEPS, SHA256, BlockRange, Strict, field_names
from .job import (AUTO_CODEC, AveragingSettings, CheckpointSettings, DatasetRef, JobSpec, ModelRef, OptimizerRef,
                  Placement, StartingWeights, TrainingSettings)
from .protocol import (ADDRESS, BANDWIDTH, FLOPS, LATENCY, SPREAD, DataChallenge, DataProof, FailureReport,
                       HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse, LinkReport, MetricsReport,
                       NodeProfile, Offered, PeerProbe, plausible_bandwidth)

__all__ = ["ADDRESS", "AUTO_CODEC", "BANDWIDTH", "DATASET_NAME", "FINGERPRINT", "FLOPS", "HEX_NONCE", "LATENCY",
           "MAX_STEPS", "SHA256", "SPREAD", "AveragingSettings", "BlockRange", "CheckpointSettings", "DataChallenge",
           "DataProof", "DatasetRef", "FailureReport", "HeartbeatRequest", "HeartbeatResponse", "JobSpec",
           "JoinRequest", "JoinResponse", "LinkReport", "MetricsReport", "ModelRef", "NodeProfile", "Offered",
           "OptimizerRef", "PeerProbe", "Placement", "RelayOffer", "Ring", "StageAssignment", "StagePeer",
           "StartingWeights", "Strict", "TrainingSettings", "field_names", "plausible_bandwidth"]
