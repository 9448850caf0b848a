"""The rules for nodes that fail, as a list: one class per file in this folder, each observing one kind
of timestamped fact and answering with typed decisions (base.py). The services feed them what they see
(`FailureRules.observe`) and carry out what they decide; no rule touches the store.

    heartbeat.py   SilentNode       Silence   -> NodeGone                     a node stopped heartbeating
    stall.py       StalledStage     Stall     -> Replan                       a lone stage stopped progressing
    slow_stage.py  SlowStage        JobPace   -> CorrectFlops, Replan         a stage far slower than its cluster
    reports.py     FailureReports   Report    -> Replan, Blame | FailJob      whom a failure report leaves out
    accusations.py Accusations      Accusation -> AccusationRecord, Blame, Revoke  whom a refusal convicts
    relay.py       RelayBlame       Report    -> Spare, Blame                 a relay lost what it carried
    quarantine.py  Quarantined      Blamed    -> BlameRecord, Quarantine      a node whose word re-plans too often

A new rule is one file here: a `Rule` subclass decorated with `@rule`, with its threshold a named
setting in coordinator/config.py. It is found by listing this folder (as strategies and codecs are);
installed packages may add rules through the entry-point group "ravnest.failure_rules".
"""
from __future__ import annotations

from typing import TypeVar

from ravnest.plugins import PluginRegistry

from ..config import Settings
from .base import Decision, Observation, Rule

R = TypeVar("R", bound=type)
_REGISTRY: PluginRegistry[type] = PluginRegistry("ravnest.failure_rules", "failure rule", LookupError,
                                                 package=__name__)


def rule(cls: R) -> R:
    """Class decorator: `cls` is one of the rules every coordinator applies."""
    _REGISTRY.register(cls.__name__, cls)
    return cls


class FailureRules:
    """Every registered rule, each with its own memory; `observe` asks the ones that observe its kind."""

    def __init__(self, settings: Settings, rules: list[type] | None = None):
        chosen = rules if rules is not None else registered()
        self.rules: list[Rule] = [cls(settings) for cls in chosen]

    def observe(self, observation: Observation) -> list[Decision]:
        """What the rules that observe `observation`'s kind decide, in the order of their names."""
        return [decision for r in self.rules if isinstance(observation, r.observes)
                for decision in r.decide(observation)]

    def forget(self, job_id: str) -> None:
        for r in self.rules:
            r.forget(job_id)


def registered() -> list[type]:
    return sorted(_REGISTRY.items(), key=lambda cls: cls.__name__)
