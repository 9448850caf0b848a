"""Spot checks of pipeline stages: secret audit micro-batches that every cluster runs, compared across
clusters where their stages start at the same block.

A stage that sends the next one noise of the honest scale, or the right activations plus something
the plausibility check (plausibility.py) cannot see, or flipped labels, goes unnoticed by its receiver
alone: it has nothing to compare with. Its replicas in the other clusters do: on the same examples,
their stages send activations that differ only by how far the replicas' weights drifted apart since
the last averaging round. So:

1. Stage 0 of every cluster swaps one micro-batch in each block of AUDIT_EVERY for audit j: rows
   drawn from the whole training set by (seed, j). Where in the block, and the key of step 3, come
   from the job generation's `audit_secret`, which only stage-0 nodes get (the coordinator derives
   it), so every cluster runs audit j at the same micro-batch and later stages cannot tell an audit
   from any other micro-batch.
2. Every later stage keeps the input of its last `window` + 1 micro-batches. Once an audit's
   micro-batch has been forwarded by every stage (stage 0 sends micro-batch m + K only after m came
   back, K the window), stage 0 reveals it on that message: m, j and the key.
3. Each stage then sketches its input of m under the key (a random projection to SKETCH numbers that
   the sender could not know: it cannot hide a change in the projection's null space), with a digest
   of the labels, and sends both to the ring peers of its first block.
4. Stage s judges audit j once the peers whose stages start at its block (3 or more clusters in all)
   have answered, and, unless s = 1, once the stage before it said its own input of j was fine (a
   stage whose input was off refuses its sender, so the one after it would blame an honest messenger),
   or AUDIT_WAIT_S passed. Its input is off when its sketch lies more than FAR times as far from the
   coordinate-wise median of all sketches as the others' median distance from it, and farther than
   FLOOR of the median's norm. Off in STRIKES audits in a row, or with labels whose digest differs
   where the others agree, the stage refuses its sender as an outlier (PipelineError, kind
   `outlier`): the coordinator leaves it out of the job and records the accusation
   (coordinator/failure_rules/accusations.py).

The tolerance. Honest replicas' sketches differ by their weights' drift since the last averaging
round: in honest 200-step runs of tests/test_audits.py's job (3 clusters of 3 stages, digits, ring
every 10 steps) a cluster's sketch lay at most 0.28 to 0.37 of its input's norm from the median (most
within 0.04; the median sketch itself is within 0.7 to 1.3 of that norm). So an input is off beyond
FLOOR (0.7) of its norm, in STRIKES (2) audits in a row. Noise of the honest scale lies ~1.4 norms
away (|noise - h| ~ sqrt(2) |h|), zeros one norm: both are refused at their second audit. A change
under 0.7 of the activations' size, or a lie in fewer than STRIKES audits in a row, passes.

What it cannot see: lies of stage 0 (it knows its audits; its garbage is poisoned data, left to robust
averaging), gradients sent back (they depend on the labels and later stages' weights), clusters whose
stages start at other blocks (the planner cuts a robust job's pipelines of one depth alike where one cut
fits them all: coordinator/planning.py), and a job of fewer than 3 clusters (no majority). A peer's sketch is
known by the cluster it names: a liar among the peers that sends sketches in another's name makes the
audit void (two different sketches for one cluster), not a verdict, unless the real peer never answers.
Audits run where `averaging.robust` is set, the setting for volunteers not trusted; their secret
choice makes a run not reproducible bit for bit.
"""
from __future__ import annotations

import contextlib
import random
import statistics
import threading
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ravnest.data import Dataset
from ravnest.failures import FailureKind
from ravnest.pipeline.inbox import PipelineError
from ravnest.spec import StageAssignment
from ravnest.wire import Message, OutboundStream, PeerError, Router

Batch = tuple[torch.Tensor, torch.Tensor]
KIND = "audit"
AUDIT_EVERY = 16   # one micro-batch in each block of this many is an audit
SKETCH = 32        # numbers in a sketch
FAR = 4.0          # an input this many times the others' median distance from the median is off ...
FLOOR = 0.7        # ... and farther than this share of the input's norm (replicas drift: the module docstring)
STRIKES = 2        # audits in a row an input must be off before its sender is refused
AUDIT_WAIT_S = 30.0  # how long a stage waits for the previous stage's word before it judges anyway
CHECK_BITS = 0xFFFF  # the key's bits a sketch names its key by (the rest stays secret)
KEEP = 64          # audits remembered (peers' sketches that arrive early, or never get judged)
_REVEAL = ("audit_of", "audit_no", "audit_key")  # tags: micro-batch, audit number, sketch key


def audits_for(a: StageAssignment, router: Router, window: int, parts: int) -> AuditPicker | AuditCheck | None:
    """What a stage does for spot checks: pick (stage 0), check (a later stage with 2 or more aligned
    peers), or nothing (no `averaging.robust`, one stage, or too few clusters)."""
    if not a.averaging.robust or a.num_stages < 2 or a.num_clusters < 3:
        return None
    peers = {} if a.is_first else aligned_peers(a)
    if len(peers) < 2:  # with itself, 3 or more clusters make a majority to judge by
        # a ring peer cut elsewhere may take this stage for an aligned one: its sketches are dropped
        router.route(KIND, lambda msg, peer: None)
    if a.is_first:
        return None if a.audit_secret is None else AuditPicker(a.audit_secret, a.training.seed, window, parts)
    return AuditCheck(a, router, window, peers) if len(peers) >= 2 else None


def aligned_peers(a: StageAssignment) -> dict[int, str]:
    """Cluster -> address of the ring peers whose stage starts at this stage's first block, itself left out
    (a member that does not say where its stage starts is taken for one; if it starts elsewhere, its
    sketches say so and are not compared)."""
    return {c: member.address for ring in a.rings if ring.blocks[0] == a.blocks[0]
            for c, member in enumerate(ring.members)
            if c != a.cluster and member.starts_at in (None, a.blocks[0])}


def audit_rows(seed: int, j: int, count: int, rows: int) -> torch.Tensor:
    """The training rows of audit j: the same in every cluster, drawn from the whole set."""
    return torch.randint(count, (rows,), generator=torch.Generator().manual_seed(seed * 7919 + j + 1))


def sketch(x: torch.Tensor, key: int) -> torch.Tensor:
    """A random linear projection of `x` to SKETCH numbers, keyed (a count sketch): the key puts each row
    r of x's last dimension in a bucket b_r with a sign s_r, and sketch[b] = sum over its rows of
    s_r * (x_r . g_b), g_b Gaussian. It keeps distances on average (E|sketch(a) - sketch(b)|^2 =
    |a - b|^2), and without the key a change cannot be aimed at what it leaves unchanged."""
    rows = x.detach().float().cpu().reshape(-1, x.shape[-1])
    g = torch.Generator().manual_seed(key)
    bucket = torch.randint(0, SKETCH, (rows.shape[0],), generator=g)
    signs = torch.randint(0, 2, (rows.shape[0],), generator=g).float() * 2 - 1
    directions = torch.randn(SKETCH, rows.shape[1], generator=g)
    values = signs * (rows * directions[bucket]).sum(1)
    return torch.zeros(SKETCH).index_add_(0, bucket, values)


def labels_digest(y: torch.Tensor) -> int:
    return zlib.crc32(y.detach().to(torch.int64).cpu().numpy().tobytes())


def off_by(own: torch.Tensor, others: list[torch.Tensor], scale: float) -> float | None:
    """How far sketch `own` lies from the median of all, in the others' median distances, where that
    makes it off (see the module docstring; `scale`: the norm of the input it sketches); None where
    it is not."""
    median = torch.stack([own, *others]).median(0).values
    mine = float((own - median).norm())
    typical = statistics.median(float((o - median).norm()) for o in others)
    if mine > FAR * typical and mine > FLOOR * scale:
        return mine / max(typical, 1e-12)
    return None


class AuditPicker:
    """Stage 0: which micro-batches are audits (secret until revealed), and their rows."""

    def __init__(self, secret: int, seed: int, window: int, parts: int = 1):
        """`parts`: micro-batches a batch is cut into; an audit replaces the first part of a batch, of the
        same size in every cluster (sketches of different sizes do not compare)."""
        self.secret, self.seed, self.window, self.parts = secret, seed, window, parts
        self.block = parts * max(1, AUDIT_EVERY // parts)  # micro-batches per audit
        self._audits: dict[int, tuple[int, int]] = {}  # micro-batch -> (audit number, key)

    def swap(self, m: int, batch: Batch, dataset: Dataset) -> Batch:
        """Micro-batch m as stage 0 sends it: `batch`, or audit rows of the same size. Audit j is at the
        place in micro-batches [j * block, (j + 1) * block) that the secret draws, the same in every
        cluster, so all run it at about the same point of training."""
        j, offset = divmod(m, self.block)
        draw = random.Random(f"{self.secret}:{j}")
        if offset != self.parts * draw.randrange(self.block // self.parts):
            return batch
        rows = audit_rows(self.seed, j, len(dataset.train_x), len(batch[1]))
        self._audits[m] = j, draw.getrandbits(62)
        return dataset.train_x[rows], dataset.train_y[rows]

    def tags(self, m: int) -> dict[str, int]:
        """The reveal message m carries: the audit of micro-batch m - window, if it was one."""
        audit = self._audits.pop(m - self.window, None)
        return {} if audit is None else dict(zip(_REVEAL, (m - self.window, *audit)))

    def close(self) -> None:
        pass


@dataclass
class _Audit:
    """One audit at one stage."""
    own: tuple[torch.Tensor, int] | None = None  # this stage's sketch and labels' digest, once revealed
    scale: float = 0.0  # the norm of this stage's input
    # cluster -> its sketch, labels' digest and key check (None: void)
    peers: dict[int, tuple[torch.Tensor, int, int] | None] = field(default_factory=dict)
    check: int | None = None  # the key's last bits: a sketch under another key does not compare
    made: float = 0.0  # when the reveal came
    since: float | None = None  # when it had every peer's sketch it would wait for


class AuditCheck:
    """A later stage: keeps its inputs, sketches the revealed audits, trades sketches with its aligned
    peers and judges (see the module docstring). `received` runs on the worker thread; sketches arrive
    on gRPC's."""

    def __init__(self, assignment: StageAssignment, router: Router, window: int, peers: dict[int, str],
                 clock=time.monotonic):
        a = self.assignment = assignment
        self._clock = clock
        self._inputs: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._keep = window + 1
        self._audits: OrderedDict[int, _Audit] = OrderedDict()
        self._lock = threading.Lock()
        self._upstream_ok: set[int] = set()
        self._verdicts: deque[int] = deque()  # audits whose input was fine, to tell the next stage
        self._reveal: dict[str, int] = {}
        self._strikes = 0  # audits in a row whose input was off
        self.passed = 0  # audits judged fine (a stage metric: audits_passed)
        self.peers = peers  # aligned_peers(a)
        self._streams: dict[str, OutboundStream] = {}
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{a.stage}-audits")
        router.route(KIND, self._on_sketch)

    def received(self, m: int, x: torch.Tensor, y: torch.Tensor, tags: dict[str, int]) -> None:
        """Keep micro-batch m's input; act on the reveal and the previous stage's word it carries, then
        judge what can be judged (raises PipelineError naming the sender of an input that is off)."""
        # copies: a received tensor may share a frame's buffer, which later messages reuse
        self._inputs[m] = x.detach().clone(), y.detach().clone()
        while len(self._inputs) > self._keep:
            self._inputs.popitem(last=False)
        self._reveal = {k: tags[k] for k in _REVEAL if k in tags}
        if "audit_ok" in tags:
            self._upstream_ok.add(tags["audit_ok"])
        if len(self._reveal) == len(_REVEAL) and self._reveal["audit_of"] in self._inputs:
            j, key = self._reveal["audit_no"], self._reveal["audit_key"]
            x_m, y_m = self._inputs[self._reveal["audit_of"]]
            mine = sketch(x_m, key), labels_digest(y_m)
            scale = float(torch.linalg.vector_norm(x_m.detach(), dtype=torch.float32))
            with self._lock:
                audit = self._audit(j)
                audit.own, audit.scale, audit.made, audit.check = mine, scale, self._clock(), key & CHECK_BITS
                for cluster, theirs in list(audit.peers.items()):  # what came early, under another key
                    if theirs is not None and theirs[2] != audit.check:
                        del audit.peers[cluster]
            with contextlib.suppress(RuntimeError):  # (the stage's run ended)
                self._sender.submit(self._send, j, mine, key & CHECK_BITS)
        self._judge()

    def tags(self, m: int) -> dict[str, int]:
        """What the next stage hears with micro-batch m: the reveal passed on, and one verdict."""
        said = {"audit_ok": self._verdicts.popleft()} if self._verdicts else {}
        reveal, self._reveal = self._reveal, {}
        return {**reveal, **said}

    def close(self) -> None:
        self._sender.shutdown(wait=False, cancel_futures=True)
        for stream in self._streams.values():
            stream.cancel()

    # --- judging (the worker thread) --------------------------------------------------------------

    def _judge(self) -> None:
        with self._lock:
            ready = [(j, audit) for j, audit in self._audits.items() if self._due(j, audit)]
            for j, _ in ready:
                del self._audits[j]
        for j, audit in ready:
            assert audit.own is not None
            others = [p for p in audit.peers.values() if p is not None]
            digests = [d for _, d, _ in others]
            if audit.own[1] not in digests and len(set(digests)) == 1:
                self._refuse(j, "carried other labels than the same examples in every other cluster")
            far = off_by(audit.own[0], [s for s, _, _ in others], audit.scale)
            self._strikes = 0 if far is None else self._strikes + 1
            if self._strikes >= STRIKES:
                self._refuse(j, f"lay {far:.0f} times as far from the median of the {len(others) + 1} clusters' "
                                f"as the others', in {STRIKES} audits in a row")
            self._verdicts.append(j)
            self._upstream_ok.discard(j)
            self.passed += far is None

    def _due(self, j: int, audit: _Audit) -> bool:
        """Every aligned peer answered (or AUDIT_WAIT_S passed with 2 of them), and the previous stage
        said its input of j was fine (or AUDIT_WAIT_S passed after that)."""
        now = self._clock()
        if audit.own is None or sum(p is not None for p in audit.peers.values()) < 2:
            return False
        if audit.since is None:
            if len(audit.peers) < len(self.peers) and now - audit.made < AUDIT_WAIT_S:
                return False
            audit.since = now
        return self.assignment.stage == 1 or j in self._upstream_ok or now - audit.since >= AUDIT_WAIT_S

    def _refuse(self, j: int, what: str) -> None:
        sender = self.assignment.prev
        assert sender is not None
        raise PipelineError(f"audit {j}: the activations node {sender.node_id} at {sender.address} sent stage "
                            f"{self.assignment.stage} {what}; refused as an outlier", FailureKind.OUTLIER,
                            sender.address)

    # --- sketches between aligned peers (the sender's thread, gRPC's) -----------------------------

    def _audit(self, j: int) -> _Audit:
        audit = self._audits.get(j)
        if audit is None:
            audit = self._audits[j] = _Audit()
            while len(self._audits) > KEEP:
                self._audits.popitem(last=False)
        return audit

    def _send(self, j: int, mine: tuple[torch.Tensor, int], check: int) -> None:
        a = self.assignment
        msg = Message(KIND, j, {"sketch": mine[0]},
                      tags={"cluster": a.cluster, "start": a.blocks[0], "labels": mine[1], "check": check})
        for address in self.peers.values():
            try:
                stream = self._streams.get(address)
                if stream is None:
                    stream = self._streams[address] = OutboundStream(address, token=a.token, wait_ready=10.0)
                stream.send(msg, timeout=10.0)
            except PeerError:
                self._streams.pop(address, None)  # the ring's business: audits are best effort

    def _on_sketch(self, msg: Message, peer: str) -> None:
        cluster, start, labels, check = (msg.tags.get(k) for k in ("cluster", "start", "labels", "check"))
        s = msg.tensors.get("sketch")
        if (cluster not in self.peers or start != self.assignment.blocks[0] or labels is None or check is None
                or s is None or s.shape != (SKETCH,) or not s.is_floating_point() or not bool(torch.isfinite(s).all())):
            return  # not an aligned peer's sketch: nothing to judge by
        with self._lock:
            audit = self._audit(msg.id)
            if audit.check is not None and check != audit.check:
                return  # a sketch under another key (a stage 0 with another secret): it does not compare
            known = audit.peers.get(cluster, ...)
            # a second, different sketch in one cluster's name: someone poses as it; it counts for nothing
            if known is ...:
                audit.peers[cluster] = s.float().clone(), labels, check
            elif known is None or not torch.equal(known[0], s.float()) or known[1] != labels:
                audit.peers[cluster] = None
