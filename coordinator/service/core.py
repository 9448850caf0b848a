"""What every component of the coordinator is given: settings, the store, the lock, the clock, the
failure rules, and looking up jobs, plans and the node behind a token. One lock serialises every
change, in all the coordinator processes on one store (db_locks.py), but for the writes that decide
nothing for others (a join, when nodes were seen, what dialling one found: row and keyed locks); each
operation is one SQL transaction, so a refused request writes nothing. State that must survive a
restart lives in the store.

Per-process state, all of it soft: rebuilt, or harmless to lose on a restart, and harmless where
another process on the same store keeps a different one (a node's next call may go to either). Each
component keeps its own, and says so where it is kept:
    Core          parsed plans (and jobs.spec_of: parsed specs), the failure rules' memory (since when a
                  stage has been slow: a restart only starts the window again)
    LinkProbes    the probes asked for and not yet answered, nodes that measured enough (Membership's)
    Presence      sightings not yet written (at most half a second's: a crash loses them, and the
                  node's next beat says it again), the live nodes' count the interval comes from
    Credentials   uses of unlimited join tokens not yet counted in the store (a crash loses a tick's:
                  the count is shown, it limits nothing); credentials without a use limit as read
                  at most a second ago (a revocation elsewhere takes up to that to be seen here)
    Reachability  what dial-backs found, not yet written (half a second's: a crash loses them, and
                  the node shows as not dialled yet until its link probes say otherwise)
    Placement     why a node was left out of the last placement; what a running job was last weighed
                  with for growing
    the app       open bandwidth probes per credential (routes/site.py)
Everything else lives in the store.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Protocol

from sqlalchemy import ColumnElement, Float, Row, Select, bindparam, func, select
from sqlalchemy.orm import Session

from ravnest.data.datasets import resident_bytes
from ravnest.models import build_model, profile_blocks, state_shapes
from ravnest.models.profile import BlockCost
from ravnest.spec import JobSpec

from ..beat_history import BeatHistory
from ..config import Settings
from ..db_locks import ChangeLock
from ..service_errors import Forbidden, NotFound, Unauthorized
from ..failure_rules import FailureRules
from ..files import rms
from ..schemas import Plan
from ..security import bearer_token, derive_token, hash_token, token_file
from ..store import CredentialRow, JobRow, NodeRow, StageRow, Store, stage_of_node

IDLE, BUSY, GONE = "idle", "busy", "gone"
HEADER_ALLOWANCE = 1 << 20  # safetensors JSON header on top of the tensors' bytes
OPTIMIZER_STATE_FACTOR = 3  # a checkpoint holds parameters plus at most this many copies (Adam: 2)
PERIODIC = "periodic"  # the other kind of stored state is "snapshot", handed in at a re-plan
LOST, GROW, RESUME = "lost", "grow", "resume"  # why a job was re-planned
MAX_LINKS_PER_NODE = 16  # a node stops being asked for probes once it measured this many links
ROOT_OPERATOR, ROOT_JOIN = "operator", "join"  # ids of the credentials kept in files (or given with --token)


@functools.lru_cache(maxsize=32)
def _block_costs(name: str, config_json: str, batch_size: int, precision: str) -> tuple[BlockCost, ...]:
    """Profiled on fake tensors: no weights are allocated, whatever the model's size."""
    return tuple(profile_blocks(build_model(name, json.loads(config_json)), batch_size, precision=precision))


def costs_of(spec: JobSpec) -> list[BlockCost]:
    """The model's block costs for this job, the first block carrying the stage's data feed."""
    costs = list(_block_costs(spec.model.name, json.dumps(spec.model.config, sort_keys=True),
                              spec.training.batch_size, spec.training.precision))
    costs[0] = dataclasses.replace(costs[0], feed_bytes=resident_bytes(spec.dataset))
    return costs


@functools.lru_cache(maxsize=32)
def state_shapes_of(name: str, config_json: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every key of the full model's state dict -> (shape, bytes), from the meta device."""
    return state_shapes(build_model(name, json.loads(config_json)))


@functools.lru_cache(maxsize=1024)
def initial_rms_of(name: str, config_json: str, index: int) -> dict[str, float]:
    """Block `index`'s state-dict keys ("{index}.<name>") -> the RMS of their initial values: built
    alone on the CPU, once per model and block (the scale of an initialisation hardly depends on its seed)."""
    block = build_model(name, json.loads(config_json)).block(index, seed=0)
    return {f"{index}.{key}": rms(tensor) for key, tensor in block.state_dict().items() if tensor.is_floating_point()}


class Core:
    """What the components share (see __init__.py); they call each other only through the public
    methods of the components they are given."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # (when it makes it) the owner's only
        self.store = Store(settings.database_url)
        self.clock = settings.clock
        self.started_at = self.clock()
        self.lock = ChangeLock(settings.database_url)  # every change (db_locks.py: across processes too)
        # when a node is gone, too slow or not believed (failure_rules/); their memory is per process, on
        # purpose: a restarted coordinator observes again, which only delays a decision
        self.rules = FailureRules(settings)
        self.beats = BeatHistory()  # when each node's beats came: how long a silence of it is unusual
        self._plans: dict[str, tuple[dict | None, Plan]] = {}  # job id -> (its stored plan, parsed)
        self._holder: Select | None = None  # holder_of's statement
        # secure by default: without configured tokens, the coordinator makes its own and keeps them in
        # owner-only files (the log says where); nothing but /healthz is open without one
        self.probe_token = token_file(settings.data_dir / "probe_token")
        self.operator_token = settings.operator_token or token_file(settings.data_dir / "operator_token")
        self.join_token = settings.join_token or token_file(settings.data_dir / "join_token")
        self._secret = token_file(settings.data_dir / "secret")  # job credentials derive from it
        self._install_root_credentials()

    def _install_root_credentials(self) -> None:
        """The operator token and the default join token are credentials like any other (listed,
        revocable). A revoked one stays revoked across restarts; a new file or --token replaces it."""
        with self.store.session() as session:
            roots = ((ROOT_OPERATOR, "key", "operator", "operator token (data directory)", self.operator_token),
                     (ROOT_JOIN, "join", None, "default join token", self.join_token))
            for row_id, kind, role, name, token in roots:
                row = session.get(CredentialRow, row_id)
                if row is None:
                    session.add(CredentialRow(id=row_id, kind=kind, role=role, name=name, token_hash=hash_token(token),
                                              created_at=self.clock(), used=0))
                elif row.token_hash != hash_token(token):
                    row.token_hash, row.revoked_at, row.created_at = hash_token(token), None, self.clock()

    def job(self, session: Session, job_id: str, owner: str | None = None) -> JobRow:
        """The job; with `owner`, only if that key submitted it."""
        job = session.get(JobRow, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if owner is not None and job.owner != owner:
            raise Forbidden(f"job {job_id} was submitted with another key; a submitter acts on its own jobs only")
        return job

    def job_member(self, session: Session, job_id: str, authorization: str | None,
                    claimed_node_id: str | None = None) -> tuple[JobRow, StageRow]:
        node = self.node_by_token(session, authorization)
        job = self.job(session, job_id)
        if claimed_node_id is not None and claimed_node_id != node.id:
            raise Forbidden(f"the token belongs to node {node.id}, not {claimed_node_id}")
        stage = stage_of_node(session, job.id, node.id)
        if stage is None:
            raise Forbidden(f"node {node.id} is not part of job {job_id}")
        return job, stage

    def peer_token(self, job: JobRow, node_id: str) -> str:
        """`node_id`'s gRPC credential in the job's current generation: derived, so the database holds
        none; the other nodes of the job get only its hash."""
        return derive_token(self._secret, "peer", job.id, str(job.generation), node_id)

    def audit_secret(self, job: JobRow) -> int:
        """What the job generation's stage-0 nodes draw their audits from (ravnest/pipeline/audits.py)."""
        return int.from_bytes(derive_token(self._secret, "audits", job.id, str(job.generation)).encode()[:8]) >> 1

    def relay_secret(self, relay: str) -> bytes:
        """What the tokens of a relay (ravnest/relay; "coordinator" or a relaying node's id) derive from:
        the same after a restart, so nodes listening on the relay before it are let in again."""
        return derive_token(self._secret, "relay", relay).encode()

    def plan(self, job: JobRow) -> Plan:
        """The job's plan, parsed once per process and plan: another process may have re-planned it
        (the stored form is compared, which costs far less than parsing it)."""
        kept = self._plans.get(job.id)
        if kept is None or kept[0] != job.plan:
            kept = self._plans[job.id] = (job.plan, Plan.model_validate(job.plan))
        return kept[1]

    def keep_plan(self, job: JobRow, plan: Plan | None) -> None:
        """Store the job's plan (None: it has none until it is placed again)."""
        job.plan = None if plan is None else plan.model_dump(mode="json")
        if plan is None:
            self._plans.pop(job.id, None)
        else:
            self._plans[job.id] = (job.plan, plan)

    def holder_of(self, session: Session, address: str, other_than: str = "") -> Row | None:
        """The live node (other than `other_than`) that holds `address` (its id, name and address): peers
        dial it there, so no other node may take it. Every join asks: one statement, built once."""
        if self._holder is None:
            self._holder = select(NodeRow.id, NodeRow.name, NodeRow.address).where(
                NodeRow.address == bindparam("address"), NodeRow.id != bindparam("other_than"),
                NodeRow.state != GONE, NodeRow.credential_ended.is_(None),
                self.live(bindparam("now", type_=Float))).limit(1)
        return session.execute(self._holder, {"address": address, "other_than": other_than,
                                              "now": self.clock()}).first()

    def live(self, now: float | ColumnElement[float]):
        """SQL: the node beat within its timeout (heartbeat_timeout_factor of the interval it was told)."""
        interval = func.coalesce(NodeRow.beat_interval_s, self.settings.heartbeat_interval_s)
        return NodeRow.last_seen >= now - self.settings.heartbeat_timeout_factor * interval

    def silence_s(self, node: NodeRow) -> float:
        """While its job recovers, a member silent this long is not waited for (recovery_silence_s, in
        the node's own intervals)."""
        base = self.settings.heartbeat_interval_s
        return self.settings.recovery_silence_s * (node.beat_interval_s or base) / base

    def gone(self, node: NodeRow, now: float) -> bool:
        """Silent past its timeout (as `live` says in SQL), whatever its row's state says yet."""
        interval = node.beat_interval_s or self.settings.heartbeat_interval_s
        return node.last_seen < now - self.settings.heartbeat_timeout_factor * interval

    def node_by_token(self, session: Session, authorization: str | None) -> NodeRow:
        token_hash = hash_token(bearer_token(authorization))
        node = session.scalars(select(NodeRow).where(NodeRow.token_hash == token_hash)).first()
        if node is None:
            raise Unauthorized("unknown node token")
        refusal = node_refusal(node, self.clock())
        if refusal:
            raise Unauthorized(refusal)
        return node


class Credentialed(Protocol):
    """What decides whether a node's credential still works: a NodeRow, or those columns alone."""
    id: str
    credential_ended: str | None
    token_expires_at: float | None


def node_refusal(node: Credentialed, now: float) -> str | None:
    if node.credential_ended == "revoked":
        return (f"node {node.id}'s credential was revoked, by the operator or because 2 nodes refused what it "
                f"sent as not honest (--revoke-outliers)")
    if node.credential_ended == "left":
        return f"node {node.id} has left; join again"
    if node.token_expires_at is not None and now >= node.token_expires_at:
        return f"node {node.id}'s credential expired (no heartbeat for too long); join again"
    return None


def planning_flops(node: NodeRow) -> float:
    """The FLOP/s the planner divides by: what its stages measured where that was far below its claim."""
    return node.measured_flops if node.measured_flops is not None else float(node.profile["flops"])


def planning_bandwidth(node: NodeRow) -> float:
    """The bytes/s the planner counts on: what its peers measured where that was far below its claim."""
    return node.measured_bandwidth if node.measured_bandwidth is not None \
        else float(node.profile["bandwidth_bytes_per_s"])


def quarantined(node: NodeRow, now: float) -> bool:
    """Its word caused too many re-plans (failure_rules/quarantine.py): not placed, not believed."""
    return node.quarantined_until is not None and node.quarantined_until > now


def undelivered(session: Session, job_id: str) -> int:
    return session.scalar(select(func.count()).select_from(StageRow).where(
        StageRow.job_id == job_id, StageRow.delivered.is_(False))) or 0
