"""Offers: which files nodes offer, and which of them they proved they hold (ravnest/data/proof.py).

A node's offer of a file is a claim until it answers a challenge. The first node to offer a content
(a fingerprint no live node holds and no challenge is banked for) is its reference: it answers a
bank of challenges, and holders refill the bank whenever it runs low. Every later claimant of that
content gets one banked challenge, used once, and is proven when its answer matches, refused when
it does not. A job that reads files (a dataset, starting weights) is placed only on proven holders
of one content of each: the one its spec pins (`dataset.sha256`, `model.weights.sha256`), else the
one most proven holders offer under its name, which is then pinned for the rest of the job.

    join ──► first ──(answers bank challenges)──► first
        └──► challenged ──(answer matches)──► proven
                        └──(answer differs)──► refused
"""
from __future__ import annotations

import logging
from collections import Counter

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ravnest.data import proof
from ravnest.spec import DataChallenge, DataProof, JobSpec, Offered

from ..store import ChallengeRow, NodeRow, OfferRow
from .core import GONE, Core

log = logging.getLogger(__name__)
FIRST, CHALLENGED, PROVEN, REFUSED = "first", "challenged", "proven", "refused"
HOLDS = (FIRST, PROVEN)
BANK_LOW, BANK_FILL = 8, 16  # a reference holder is asked for BANK_FILL more answers below BANK_LOW banked
BANK_WAIT_S = 60.0  # bank challenges asked for and not answered by then are forgotten


class Offers:
    def __init__(self, core: Core) -> None:
        self.core = core
        # nonce -> (node, fingerprint, ranges, when asked): bank challenges sent to a reference holder and
        # not answered yet. Soft: one lost on a restart is asked again.
        self._filling: dict[str, tuple[str, str, tuple[tuple[int, int], ...], float]] = {}

    def record(self, session: Session, node: NodeRow, profile: Offered, new: bool = False) -> None:
        """A node joined offering files: each is first, challenged, or refused (no fingerprint). A node
        that joins again under its identity offers anew: its files may have changed meanwhile (`new`:
        a node first seen now, with no offers yet to forget)."""
        now = self.core.clock()
        if not new:
            session.execute(delete(OfferRow).where(OfferRow.node_id == node.id))
        for name in profile.datasets:
            found = profile.fingerprints.get(name)
            if found is None:
                session.add(OfferRow(node_id=node.id, name=name, fingerprint="", state=REFUSED, offered_at=now,
                                     reason="no fingerprint reported (a node older than this coordinator)"))
                continue
            banked = session.scalar(select(func.count()).select_from(ChallengeRow).where(
                ChallengeRow.fingerprint == found)) or 0
            live_holders = session.scalar(select(func.count()).select_from(OfferRow).join(
                NodeRow, NodeRow.id == OfferRow.node_id).where(
                OfferRow.fingerprint == found, OfferRow.state.in_(HOLDS), NodeRow.state != GONE)) or 0
            known = banked or live_holders
            session.add(OfferRow(node_id=node.id, name=name, fingerprint=found, offered_at=now,
                                 state=CHALLENGED if known else FIRST))

    def has_news_for(self, session: Session, node_id: str) -> bool:
        """Whether `challenges_for` may have something for the node (reads only): a claim of its awaits
        its challenge, or it holds a file whose bank of challenges runs low."""
        offers = session.execute(select(OfferRow.state, OfferRow.fingerprint).where(OfferRow.node_id == node_id)).all()
        if any(state == CHALLENGED for state, _ in offers):
            return True
        held = {fingerprint for state, fingerprint in offers if state in HOLDS}
        if not held:
            return False
        banked = dict(session.execute(select(ChallengeRow.fingerprint, func.count()).where(
            ChallengeRow.fingerprint.in_(held)).group_by(ChallengeRow.fingerprint)).all())
        pending = Counter(filling[1] for filling in list(self._filling.values()))
        return any(banked.get(fingerprint, 0) + pending[fingerprint] < BANK_LOW for fingerprint in held)

    def challenges_for(self, session: Session, node: NodeRow) -> list[DataChallenge]:
        """What the node is to prove with its next heartbeat: its own claims, and bank challenges if
        it is a reference holder whose bank runs low."""
        now, asked = self.core.clock(), []
        self._filling = {n: f for n, f in self._filling.items() if now - f[3] < BANK_WAIT_S}
        for offer in session.scalars(select(OfferRow).where(OfferRow.node_id == node.id)):
            if offer.state == CHALLENGED:
                if offer.challenge is None and (entry := session.scalars(select(ChallengeRow).where(
                        ChallengeRow.fingerprint == offer.fingerprint).limit(1)).first()) is not None:
                    offer.challenge = {"nonce": entry.nonce, "ranges": entry.ranges, "expected": entry.answer}
                    session.delete(entry)  # used once
                if offer.challenge is not None:
                    asked.append(DataChallenge(dataset=offer.name, nonce=offer.challenge["nonce"],
                                               ranges=[tuple(r) for r in offer.challenge["ranges"]]))
            elif offer.state in HOLDS:  # a holder refills the bank
                banked = session.scalar(select(func.count()).select_from(ChallengeRow).where(
                    ChallengeRow.fingerprint == offer.fingerprint)) or 0
                pending = sum(f[1] == offer.fingerprint for f in self._filling.values())
                for _ in range(BANK_FILL if banked + pending < BANK_LOW else 0):
                    challenge = proof.make_challenge(proof.size_of(offer.fingerprint))
                    self._filling[challenge.nonce] = (node.id, offer.fingerprint, challenge.ranges, now)
                    asked.append(DataChallenge(dataset=offer.name, nonce=challenge.nonce,
                                               ranges=list(challenge.ranges)))
        return asked

    def take_proofs(self, session: Session, node: NodeRow, proofs: list[DataProof]) -> bool:
        """Bank a reference holder's answers; prove or refuse a claimant's. True if an offer was proven."""
        proven = False
        for given in proofs:
            filling = self._filling.pop(given.nonce, None)
            if filling is not None and filling[0] == node.id:  # a reference holder's answer: banked
                session.add(ChallengeRow(nonce=given.nonce, fingerprint=filling[1],
                                         ranges=[list(r) for r in filling[2]], answer=given.answer))
                continue
            offer = session.get(OfferRow, (node.id, given.dataset))
            if offer is None or offer.state != CHALLENGED or not offer.challenge \
                    or offer.challenge["nonce"] != given.nonce:
                continue  # late, repeated or made up: ignored
            if proof.matches(given.answer, offer.challenge["expected"]):
                offer.state, offer.reason, proven = PROVEN, "", True
            else:
                offer.state = REFUSED
                offer.reason = (f"its proof of holding {offer.name!r} did not match what the file's first holder "
                                f"answered: it does not hold that content")
                log.warning("node %s: %s", node.id, offer.reason)
            offer.challenge = None
        return proven

    def holders(self, session: Session, spec: JobSpec, nodes: list[NodeRow]) -> tuple[list[NodeRow], dict[str, str]]:
        """The nodes among `nodes` that may read every file the job reads (its dataset, its starting
        weights), and the content (sha256) each of those files is to have: for each file the content the
        job pins, else the one most proven holders offer under its name (the caller pins it once the job
        is placed). Built-in datasets need nothing: all of `nodes`, {}."""
        holding, contents = {node.id for node in nodes}, {}
        for field, source, pinned in files_read(spec):
            offers = list(session.scalars(select(OfferRow).where(OfferRow.name == source,
                                                                 OfferRow.state.in_(HOLDS))))
            sha = pinned or _most_held(offers)
            if sha is not None:
                contents[field] = sha
            holding &= {offer.node_id for offer in offers if sha is not None and offer.fingerprint.endswith(":" + sha)}
        return [node for node in nodes if node.id in holding], contents

    def unoffered(self, session: Session, spec: JobSpec) -> str:
        """The files the job reads that no live node offers, as a user reads it ("" when each is offered):
        `dataset 'books' (volunteers offer it with: ravnest-node join --dataset books=PATH)`."""
        missing = []
        for field, source, _ in files_read(spec):
            offered = session.scalar(select(func.count()).select_from(OfferRow).join(
                NodeRow, NodeRow.id == OfferRow.node_id).where(OfferRow.name == source, NodeRow.state != GONE))
            if not offered:
                flag = "--model-file" if field == "model.weights" else "--dataset"
                missing.append(f"{field.replace('.', ' ')} {source!r} (volunteers offer it with `ravnest-node join "
                               f"{flag} {source}=PATH`)")
        return " nor ".join(missing)

    def other_content(self, session: Session, spec: JobSpec) -> str:
        """The files the job pins a sha256 for that live nodes hold only with other content, as a user
        reads it ("" when none): `model weights 'base' is held by 5 nodes with sha256 1a2b..., not the
        job's model.weights.sha256 9f8e...` (a wrong checksum in the spec, or a file changed since)."""
        wrong = []
        for field, source, pinned in files_read(spec):
            if pinned is None:
                continue
            held = Counter(fingerprint.rpartition(":")[2] for fingerprint in session.scalars(
                select(OfferRow.fingerprint).join(NodeRow, NodeRow.id == OfferRow.node_id).where(
                    OfferRow.name == source, OfferRow.state.in_(HOLDS), NodeRow.state != GONE)))
            if held and pinned not in held:
                sha, nodes = held.most_common(1)[0]
                wrong.append(f"{field.replace('.', ' ')} {source!r} is held by {nodes} node{'s' * (nodes != 1)} "
                             f"with sha256 {sha[:16]}..., not the job's {field}.sha256 {pinned[:16]}...")
        return "; ".join(wrong)

    def vocabulary_refusal(self, session: Session, spec: JobSpec, vocab: int | None) -> str:
        """Why the job cannot train on any token file offered under its source, where every live node
        that offers it says it has more ids than the model's `vocab` ("" where one fits, or none is
        offered yet: then placement waits for one, `too_many_ids`)."""
        if spec.dataset.name != "tokens" or not spec.dataset.source or vocab is None:
            return ""
        offering = list(session.scalars(select(NodeRow).join(OfferRow, OfferRow.node_id == NodeRow.id).where(
            OfferRow.name == spec.dataset.source, OfferRow.state.in_(HOLDS), NodeRow.state != GONE)))
        sizes = self.too_many_ids(spec, vocab, offering)
        if not offering or len(sizes) < len(offering):
            return ""
        least = min(sizes.values())
        return (f"the model's vocab_size {vocab:,} is below the {least:,} ids of token file "
                f"{spec.dataset.source!r}, as every node offering it says (`ravnest data prepare` prints what a "
                f"model needs): set model.config.vocab_size to {least:,} or more")

    @staticmethod
    def too_many_ids(spec: JobSpec, vocab: int | None, nodes: list[NodeRow]) -> dict[str, int]:
        """node id -> the vocabulary of the token file it offers for the job, for those of `nodes` whose
        file has more ids than the model's `vocab` (a stage there would fail at its first batch)."""
        if spec.dataset.name != "tokens" or not spec.dataset.source or vocab is None:
            return {}
        found = {node.id: (node.profile.get("vocab_sizes") or {}).get(spec.dataset.source) for node in nodes}
        return {node_id: size for node_id, size in found.items() if size is not None and size > vocab}

    def describe(self, session: Session, node_ids: list[str]) -> dict[str, dict[str, str]]:
        """node id -> each file it offers -> its state (and why, where it was refused)."""
        described: dict[str, dict[str, str]] = {}
        for offer in session.scalars(select(OfferRow).where(OfferRow.node_id.in_(node_ids))):
            described.setdefault(offer.node_id, {})[offer.name] = offer.state + (
                f": {offer.reason}" if offer.reason else "")
        return described


def files_read(spec: JobSpec) -> list[tuple[str, str, str | None]]:
    """(field, offered name, pinned sha256 or None) of each offered file the job reads."""
    files = []
    if spec.dataset.source is not None:
        files.append(("dataset", spec.dataset.source, spec.dataset.sha256))
    if spec.model.weights is not None:
        files.append(("model.weights", spec.model.weights.source, spec.model.weights.sha256))
    return files


def _most_held(offers: list[OfferRow]) -> str | None:
    """The sha256 most proven holders offer (ties: the one offered first)."""
    if not offers:
        return None
    count = Counter(offer.fingerprint for offer in offers)
    first: dict[str, float] = {}
    for offer in sorted(offers, key=lambda o: o.offered_at):
        first.setdefault(offer.fingerprint, offer.offered_at)
    best = max(count, key=lambda f: (count[f], -first[f]))
    return best.split(":", 1)[1]
