"""An accusation is a claim too. A node that refused a peer's values (not finite, or far beyond the
others': an outlier) says that peer lied; but the accuser may be the liar, and one witness cannot tell
the two apart. So:

- the accused is always left out of the job it was accused in (reports.py): whoever lies, the job goes
  on without that pair's link, and a liar that accuses costs a job one node, once;
- it is blamed, and as an outlier revoked where the operator asked (`revoke_outliers`), only once
  `corroborate_after` different nodes accused it within `quarantine_window_s`. Every honest member
  of a robust round names the same outlier at once, so a ring's or a gossip neighbourhood's liar is
  corroborated in the same round; garbage down a pipeline is seen by one neighbour, and it takes a
  second one (in this job's next plan or another job) to convict;
- an accuser whose accusations nobody corroborated, against `corroborate_after` different nodes within
  the window, is the likelier liar, and each such accusation counts against it instead. An earlier
  accusation counts so only once `corroborate_within_s` passed without a second accuser: an honest
  member of a round that convicted two liars accuses both at once, and the others' reports of the
  first may come after its own of the second.

Worked example, corroborate_after = 2: r accuses p (p left out, nobody blamed); q accuses p too (p
blamed and, with revoke_outliers, revoked). A liar l accuses a, then, a minute or more later, b, honest
both: a is left out, and then b is, and l is blamed, because nobody else found a or b lying.
"""
from __future__ import annotations

from . import rule
from .base import Accusation, AccusationRecord, Blame, Decision, Revoke, Rule


@rule
class Accusations(Rule[Accusation]):
    observes = Accusation

    def decide(self, seen: Accusation) -> list[Decision]:
        window, needed = self.settings.quarantine_window_s, self.settings.corroborate_after
        accusers = (*((who, at) for who, at in seen.accusers if seen.at - at < window and who != seen.accuser_id),
                    (seen.accuser_id, seen.at))
        accused = (*((who, at, also) for who, at, also in seen.accused
                     if seen.at - at < window and who != seen.accused_id), (seen.accused_id, seen.at, False))
        decided: list[Decision] = [AccusationRecord(seen.accused_id, accusers=accusers),
                                   AccusationRecord(seen.accuser_id, accused=tuple((w, at) for w, at, _ in accused))]
        if len(accusers) >= needed:
            decided.append(Blame(seen.accused_id, seen.reason))
            if seen.outlier and self.settings.revoke_outliers:
                decided.append(Revoke(seen.accused_id, seen.reason))
            return decided
        settled = self.settings.corroborate_within_s
        alone = [who for who, at, also in accused if not also and (seen.at - at >= settled or who == seen.accused_id)]
        if len(alone) >= needed:
            decided.append(Blame(seen.accuser_id, f"it accused {len(alone)} different nodes within {window:.0f} s "
                                                  f"that no other node accused; the last: {seen.reason}"))
        return decided
