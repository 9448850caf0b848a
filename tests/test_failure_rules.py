"""The failure rules on their own, with plain values and a clock of their own: a stage slower than its
cluster for the whole window is re-planned around; stages slower alike (a shared machine) are not; a
lone stage far off its node's profile corrects that profile; silence, stalls, reports, relays and
quarantine each decide as documented. And the rules are a list: a new one is a file in a folder."""
from __future__ import annotations

import dataclasses
import importlib
import textwrap

import pytest

from coordinator.beat_history import BeatHistory, suspect_after_s
from coordinator.config import Settings
from coordinator.failure_rules import FailureRules, registered
from coordinator.failure_rules.base import (Accusation, AccusationRecord, Blame, Blamed, BlameRecord, CorrectFlops,
                                            FailJob, JobPace, Member, NodeGone, Quarantine, Replan, Report, Revoke,
                                            Silence, Spare, StagePace, Stall)
from ravnest.failures import Failure, FailureKind


def pace(ratios: list[float], at: float, step: int = 50, flops: float = 1e10, clusters: list[int] | None = None
         ) -> JobPace:
    """Stages of 1e8 FLOPs a micro-batch on nodes claiming `flops`, each `ratio` times its prediction."""
    clusters = clusters or [0] * len(ratios)
    return JobPace(at, "job", tuple(StagePace(at, "job", f"node-{i}", f"n{i}", cluster, i, step, 0.01 * ratio, 0.01,
                                              flops, 1e8)
                                    for i, (ratio, cluster) in enumerate(zip(ratios, clusters))))


@pytest.fixture
def rules(tmp_path):
    return lambda **settings: FailureRules(Settings(data_dir=tmp_path, **settings))


def test_every_rule_in_the_folder_is_on_the_list() -> None:
    assert [rule.__name__ for rule in registered()] == ["Accusations", "FailureReports", "Quarantined", "RelayBlame",
                                                          "SilentNode", "SlowStage", "StalledStage"]


def test_a_stage_slower_than_its_cluster_for_the_whole_window_is_named(rules) -> None:
    rules = rules(slow_factor=4.0, slow_window_s=10.0)
    assert rules.observe(pace([1.0, 12.0], at=100)) == []  # slow from here on
    assert rules.observe(pace([1.0, 12.0], at=105)) == []
    correct, replan = rules.observe(pace([1.0, 12.0], at=110))
    assert correct == CorrectFlops("node-1", 1e10 / 12)  # as fast as the plan would have predicted its slowness
    assert isinstance(replan, Replan) and replan.left_out == ("node-1",) and replan.failure.kind == FailureKind.SLOW
    assert replan.reason == ("node n1 is too slow: cluster 0 stage 1 computes a micro-batch in 120 ms, 12.0x the "
                             "10 ms planned (the other stages of its cluster: 1.0x); re-planning without it")
    assert "slow in every report for 10 s" in replan.failure.detail


def test_reports_are_counted_in_time_not_in_number(rules) -> None:
    rules = rules(slow_window_s=10.0)
    for at in (100.0, 100.5, 101.0, 101.5, 102.0, 102.5):  # many reports, little time
        assert rules.observe(pace([1.0, 12.0], at=at)) == []
    assert rules.observe(pace([1.0, 12.0], at=110.0)) != []


def test_a_normal_report_within_the_window_starts_it_again(rules) -> None:
    rules = rules(slow_window_s=10.0)
    for at, ratios in ((100, [1.0, 12.0]), (106, [1.0, 1.2]), (108, [1.0, 12.0]), (112, [1.0, 12.0])):
        assert rules.observe(pace(ratios, at=at)) == []
    assert rules.observe(pace([1.0, 12.0], at=118)) != []


def test_a_stage_is_compared_with_its_own_cluster_first(rules) -> None:
    """Cluster 1 runs on a slower machine: both its stages are 9x, and neither is slow next to the other;
    cluster 0's slow stage is slow next to its own peer."""
    rules = rules(slow_window_s=0.0)
    assert rules.observe(pace([1.0, 1.0, 9.0, 9.0], at=1, clusters=[0, 0, 1, 1])) == []
    decided = rules.observe(pace([1.0, 9.0, 9.0, 9.0], at=2, clusters=[0, 0, 1, 1]))
    assert [d.node_id for d in decided if isinstance(d, CorrectFlops)] == ["node-1"]


def test_stages_slower_alike_and_early_steps_are_left_alone(rules) -> None:
    rules = rules(slow_window_s=0.0, slow_after_steps=20)
    assert rules.observe(pace([6.0, 7.0, 9.0, 6.5], at=1)) == []  # every node on a busy machine
    assert rules.observe(pace([1.0, 3.5], at=1)) == []  # within the planner's error
    # measured on healthy nodes, four on two cores with stages of a few ms: not a slow node
    assert rules.observe(pace([2.3, 2.3, 9.2], at=1)) == []
    assert rules.observe(pace([0.5, 5.3], at=1)) == []
    assert rules.observe(pace([1.0, 30.0], at=1, step=10)) == []  # still warming up
    assert rules.observe(pace([30.0], at=1)) == []  # nobody to compare with


def test_a_lone_stage_far_off_its_profile_is_a_false_claim_and_gets_the_measured_figure(rules) -> None:
    """The maximal fake profile: 1e17 FLOP/s claimed, and 1e8 FLOPs computed in 4 ms (2 of them the
    plan's fixed cost): 5e10 measured. No peers to compare with, so the bound is claim_factor, far
    above what crowding explains."""
    rules = rules(slow_window_s=0.0)
    assert rules.observe(pace([0.4], at=1, flops=4e12)) == []  # claimed 80x what it computes like
    assert rules.observe(pace([0.2], at=1, flops=1e17)) == []  # the fixed cost alone: no figure
    correct, replan = rules.observe(pace([0.4], at=1, flops=1e17))
    assert correct.flops == pytest.approx(5e10)
    assert replan.failure.message == ("computes like 50.0 GFLOP/s, where its profile claimed 100,000,000.0 (a "
                                      "micro-batch in 4.0 ms, not 10.0)")


def test_a_silent_node_is_suspect_and_gone_only_on_more_evidence(rules) -> None:
    """Late beats alone do not convict a node (a busy laptop, a Wi-Fi hiccup): its cluster's steps do, or
    a long silence. The module docstring's worked example."""
    rules = rules(heartbeat_interval_s=2.0, heartbeat_timeout_factor=3.0, heartbeat_dead_factor=10.0)

    def silent(at: float, cluster_step: int | None = 40, job_id: str | None = "job") -> list:
        return rules.observe(Silence(at=at, node_id="a", who="a (1)", last_seen=100.0, interval_s=2.0,
                                     job_id=job_id, cluster_step=cluster_step))
    assert silent(105.9) == [] and silent(106.0) == []  # suspect from 106 s
    assert silent(110.0, 44) == [] and silent(115.9, 44) == []  # its cluster stepped at 110 s: alive
    [gone] = silent(116.0, 44)
    assert gone == NodeGone("a", "node a (1) stopped sending heartbeats (last seen 16 s ago) and its cluster "
                                 "made no step for 6 s", gone.failure)
    assert gone.failure.kind == FailureKind.SILENT and gone.failure.peer_id == "a"
    # a cluster that keeps stepping keeps it until the long silence; idle, only that convicts it
    assert all(silent(at, step) == [] for at, step in [(106, 40), (111, 41), (116, 42), (119.9, 43)])
    [gone] = silent(120.0, 44)
    assert gone.reason == "node a (1) stopped sending heartbeats (last seen 20 s ago)"
    assert silent(119.9, None, None) == [] and silent(120.0, None, None)[0].failure.detail == "heartbeat_dead_factor 10"


def test_a_node_whose_beats_wander_is_given_the_room_its_history_shows(rules) -> None:
    """A steady node is suspect after the fixed 6 s (beat_history.py); one whose recent gaps included
    8 s ones only SIGMAS spreads past its mean gap, and it is gone after twice that."""
    steady, wandering = BeatHistory(), BeatHistory()
    at = 0.0
    for gap in [2.0, 2.05, 1.95] * 10:
        at += gap
        steady.arrived("a", at)
    mean, spread = steady.usual("a")
    assert abs(mean - 2.0) < 0.03 and spread < 0.06
    assert suspect_after_s(6.0, steady.usual("a")) == 6.0 and suspect_after_s(6.0, None) == 6.0
    at = 0.0
    for gap in [1.5, 1.5, 8.0, 1.6, 1.5, 1.5, 1.4, 1.5, 8.0, 1.5, 1.5, 1.6] * 3:
        at += gap
        wandering.arrived("a", at)
    usual = wandering.usual("a")
    threshold = suspect_after_s(6.0, usual)
    assert 8.0 < threshold < 14.0, usual
    assert wandering.usual("b") is None and BeatHistory().usual("a") is None
    make, rules = rules, rules(heartbeat_interval_s=2.0, heartbeat_timeout_factor=3.0, heartbeat_dead_factor=10.0)

    def silent(at: float, cluster_step: int | None = 40) -> list:
        return rules.observe(Silence(at=at, node_id="a", who="a (1)", last_seen=100.0, interval_s=2.0,
                                     job_id="job" if cluster_step is not None else None, cluster_step=cluster_step,
                                     usual_gap=usual))
    assert silent(100 + threshold - 0.1) == []  # not yet suspect: its cluster's stand-still is not counted
    assert silent(100 + threshold + 0.1) == [] and silent(100 + 2 * threshold) == []  # suspect since
    [gone] = silent(100 + 2 * threshold + 0.2)  # ... and its cluster made no step for as long again
    assert f"its beats came every {usual[0]:.1f} s +- {usual[1]:.1f} lately" in gone.reason, gone.reason
    rules = make(heartbeat_interval_s=2.0, heartbeat_timeout_factor=3.0, heartbeat_dead_factor=10.0)
    assert silent(100 + max(20.0, 2 * threshold) - 0.1, None) == []
    assert silent(100 + max(20.0, 2 * threshold) + 0.01, None)[0].failure.kind == FailureKind.SILENT


def test_a_lone_stage_without_progress_is_stalled_not_timed_out(rules) -> None:
    rules = rules(stall_s=900.0)
    seen = Stall(at=1000.0, job_id="job", node_id="a", who="a (1)", cluster=1, stage=0, step=40, last_progress=200.0)
    assert rules.observe(seen) == []
    [replan] = rules.observe(Stall(**{**seen.__dict__, "at": 1100.0}))
    assert replan.left_out == ("a",) and replan.failure.kind == FailureKind.STALLED
    assert replan.reason == ("node a (1) reported no progress for 900 s (at step 40): cluster 1 stage 0; "
                             "re-planning without it")


def report(failure: Failure | None, recoverable: bool = True, still_training: bool = False, relayed_by=None,
           lost_seen: float = 99.0, could_not_start_on=()) -> Report:
    members = {"r": Member("r", 100.0), "p": Member("p", lost_seen, relayed_by)}
    return Report(100.0, "job", "r", "what happened", failure, recoverable, still_training, members,
                  could_not_start_on, peers={"p"})


LOST_P = Failure(kind=FailureKind.PEER_LOST, message="stream broke", peer_id="p")


def test_a_report_leaves_out_whom_it_names_and_counts_against_the_reporter(rules) -> None:
    rules = rules()
    assert rules.observe(report(LOST_P)) == [Replan("job", "what happened", LOST_P, ("p",)),
                                             Blame("r", "what happened")]
    local = Failure(kind=FailureKind.LOCAL_ERROR, message="bug")
    assert rules.observe(report(local))[0].left_out == ("r",)
    assert rules.observe(report(local, still_training=True))[0].left_out == ()  # it trains on alone


def test_a_refusal_leaves_out_the_sender_not_the_messenger(rules) -> None:
    """r refused p's values as not finite, or as an outlier (its averaging stopped, it trains on alone): p,
    the source, is left out, and the refusal is an accusation (accusations.py decides whom it counts
    against); a non-finite value of r's own names nobody else."""
    for kind in (FailureKind.NAN, FailureKind.OUTLIER):
        refused = Failure(kind=kind, message="refused", peer_id="p")
        assert rules().observe(report(refused, still_training=True)) == [
            Replan("job", "what happened", refused, ("p",))]
    own = Failure(kind=FailureKind.NAN, message="loss is nan")
    assert rules().observe(report(own)) == [Replan("job", "what happened", own, ("r",)), Blame("r", "what happened")]
    stranger = Failure(kind=FailureKind.NAN, message="refused", peer_id="not-a-member")
    assert rules().observe(report(stranger))[0].left_out == ("r",)
    # p is a member, but not one r exchanges values with: r never heard from it, so its word is its own
    not_a_peer = Failure(kind=FailureKind.OUTLIER, message="refused", peer_id="p")
    assert rules().observe(dataclasses.replace(report(not_a_peer), peers=())) == [
        Replan("job", "what happened", not_a_peer, ("r",)), Blame("r", "what happened")]


def accusation(accuser: str, accused: str, at: float, accusers=(), earlier=(), outlier: bool = True) -> Accusation:
    return Accusation(at, "job", accuser, accused, "what happened", outlier, tuple(accusers), tuple(earlier))


def test_an_accusation_convicts_only_once_a_second_node_makes_it(rules) -> None:
    """The worked example of accusations.py: r's word alone blames nobody; q's too blames p, and with
    `revoke_outliers` revokes it; the same accuser twice is still one witness, and an old accusation
    (past the window) is forgotten."""
    rules = rules(revoke_outliers=True, quarantine_window_s=100.0)
    assert rules.observe(accusation("r", "p", 10.0)) == [AccusationRecord("p", accusers=(("r", 10.0),)),
                                                         AccusationRecord("r", accused=(("p", 10.0),))]
    decided = rules.observe(accusation("q", "p", 20.0, accusers=[("r", 10.0)]))
    assert decided[2:] == [Blame("p", "what happened"), Revoke("p", "what happened")]
    assert decided[0] == AccusationRecord("p", accusers=(("r", 10.0), ("q", 20.0)))
    assert rules.observe(accusation("r", "p", 20.0, accusers=[("r", 10.0)]))[2:] == []  # r again: one witness
    assert rules.observe(accusation("q", "p", 200.0, accusers=[("r", 10.0)]))[2:] == []  # r's is too old
    refused = rules.observe(accusation("q", "p", 20.0, accusers=[("r", 10.0)], outlier=False))
    assert refused[2:] == [Blame("p", "what happened")]  # values that were not finite: blamed, not revoked


def test_an_accuser_nobody_corroborates_against_two_nodes_is_blamed_itself(rules) -> None:
    """A liar l accuses honest a, then honest b: both are left out of its job (reports.py), and l is
    blamed. Had someone else accused a too, l's word about a would stand, and nobody is blamed for b yet;
    nor where a's accusation was made within `corroborate_within_s` (others' reports of it may be on their
    way: an honest member accuses two liars a round convicted at once)."""
    rules = rules(quarantine_window_s=1000.0, corroborate_within_s=60.0)
    assert rules.observe(accusation("l", "a", 10.0))[2:] == []
    decided = rules.observe(accusation("l", "b", 100.0, earlier=[("a", 10.0, False)]))
    assert [type(d) for d in decided[2:]] == [Blame] and decided[2].node_id == "l"
    assert "accused 2 different nodes" in decided[2].reason
    assert rules.observe(accusation("l", "b", 100.0, earlier=[("a", 10.0, True)]))[2:] == []
    assert rules.observe(accusation("l", "b", 20.0, earlier=[("a", 10.0, False)]))[2:] == []  # too soon to tell
    assert rules.observe(accusation("l", "b", 2000.0, earlier=[("a", 10.0, False)]))[2:] == []  # a's is too old


def test_a_stage_that_cannot_start_fails_the_job_only_on_two_different_nodes(rules) -> None:
    rules = rules(fail_after_nodes=2)
    assert rules.observe(report(None, recoverable=False))[0].left_out == ("r",)
    assert rules.observe(report(None, recoverable=False, could_not_start_on={"r"}))[0].left_out == ("r",)
    [failed] = rules.observe(report(None, recoverable=False, could_not_start_on={"q"}))
    assert failed == FailJob("job", "what happened (the stage could not start on 2 different nodes)")


def test_a_relayed_node_that_still_beats_is_spared_and_its_relay_blamed(rules) -> None:
    rules = rules(heartbeat_interval_s=2.0, recovery_silence_intervals=2.0)
    decided = rules.observe(report(LOST_P, relayed_by="relay-node", lost_seen=99.0))
    assert Spare("p") in decided and Blame("relay-node", "what happened") in decided
    decided = rules.observe(report(LOST_P, relayed_by="relay-node", lost_seen=90.0))  # silent: it is what died
    assert Spare("p") in decided and not any(isinstance(d, Blame) and d.node_id == "relay-node" for d in decided)


def test_a_node_whose_word_replans_too_often_is_quarantined(rules) -> None:
    rules = rules(quarantine_after=3, quarantine_window_s=3600.0, quarantine_s=1800.0)
    assert rules.observe(Blamed(100.0, "r", "first", ())) == [BlameRecord("r", (100.0,))]
    assert rules.observe(Blamed(5000.0, "r", "later", (100.0,))) == [BlameRecord("r", (5000.0,))]  # out of window
    record, quarantine = rules.observe(Blamed(5002.0, "r", "third", (5000.0, 5001.0)))
    assert record == BlameRecord("r", (5000.0, 5001.0, 5002.0)) and quarantine.until == 5002.0 + 1800.0
    assert quarantine == Quarantine("r", 6802.0, "what it reported caused 3 re-plans within 3600 s; the last: third")
    # the quarantine served those three: once it ended, they are remembered (a withdrawn one lifts it) but not
    # counted again
    caused = (5000.0, 5001.0, 5002.0)
    assert rules.observe(Blamed(6900.0, "r", "fourth", caused, 6802.0)) == [BlameRecord("r", (*caused, 6900.0))]
    assert len(rules.observe(Blamed(6900.0, "r", "fourth", caused))) == 2  # had it not been served


NEW_RULE = textwrap.dedent('''
    """A node more than `factor` times slower than its cluster's median for `window_s` is replaced."""
    import statistics

    from coordinator.failure_rules import rule
    from coordinator.failure_rules.base import JobPace, Replan, Rule


    @rule
    class ThreeTimesSlower(Rule[JobPace]):
        observes = JobPace
        factor, window_s = 3.0, 300.0

        def decide(self, seen):
            ratios = {s.node_id: s.compute_s / s.predicted_s for s in seen.stages}
            median = statistics.median(ratios.values())
            for node, ratio in ratios.items():
                if ratio <= self.factor * median:
                    self.memory.pop((seen.job_id, node), None)
                elif seen.at - self.memory.setdefault((seen.job_id, node), seen.at) >= self.window_s:
                    return [Replan(seen.job_id, f"{node} is 3x slower than its cluster", None, (node,))]
            return []
''')


def test_a_new_rule_is_one_file_in_the_folder(tmp_path, monkeypatch) -> None:
    """The issue's example: '3x slower than its cluster for 5 minutes' as a file dropped into the
    folder, found by listing it like the built-ins, and applied by every FailureRules built after."""
    import coordinator.failure_rules as package
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "three_times_slower.py").write_text(NEW_RULE)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    monkeypatch.setattr(package, "_REGISTRY", package._REGISTRY.copy())
    monkeypatch.setattr(package._REGISTRY, "_imported", False)  # list the folder again
    importlib.invalidate_caches()
    rules = FailureRules(Settings(data_dir=tmp_path))
    assert "ThreeTimesSlower" in [type(rule).__name__ for rule in rules.rules]
    assert rules.observe(pace([1.0, 1.0, 4.0], at=0, step=5)) == []  # starts the 5 minutes (5 steps in)
    assert rules.observe(pace([1.0, 1.0, 4.0], at=299, step=5)) == []
    [replan] = rules.observe(pace([1.0, 1.0, 4.0], at=300, step=5))
    assert replan.left_out == ("node-2",)
