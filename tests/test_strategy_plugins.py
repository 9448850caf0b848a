"""A strategy installed by another package, with settings of its own: the job spec validates them
under the strategy's name, the planner and the runtime model read what it declares, and the stages
run it with the job's settings."""
from __future__ import annotations

import importlib.metadata
import textwrap

import pytest
import torch

from ravnest.averaging import registry
from ravnest.averaging.runtime import Group, strategy_step_s
from ravnest.pipeline.local import run_threaded_clusters
from ravnest.spec import AveragingSettings, JobSpec

PLUGIN = textwrap.dedent('''
    """Pull: at the end of training each replica moves `pull` of the way to the replicas' mean."""
    import torch
    from pydantic import Field

    from ravnest.averaging.layout import canonical_keys
    from ravnest.averaging.registry import StrategyInfo, StrategySettings
    from ravnest.averaging.strategy import AveragingStrategy, group_member


    class PullSettings(StrategySettings):
        pull: float = Field(0.5, gt=0, le=1, description="how far each replica moves to the mean")


    class Pull(AveragingStrategy):
        name = "pull"

        def __init__(self, context):
            self.pull = context.assignment.averaging.of("pull").pull
            self.live = context.live
            self.groups = [(group_member(context, ring, step_timeout=60.0), canonical_keys(context.live, ring.blocks))
                           for ring in context.assignment.rings]
            self.before_finish = {}

        def finish(self):
            self.before_finish = {k: v.clone() for k, v in self.live.items()}
            for member, keys in self.groups:
                flat = torch.cat([self.live[k].reshape(-1) for k in keys])
                mean = member.allreduce(flat, round=0)
                offset = 0
                for key in keys:
                    tensor = self.live[key]
                    part = mean[offset:offset + tensor.numel()].view_as(tensor)
                    tensor.add_(self.pull * (part - tensor))
                    offset += tensor.numel()

        def close(self):
            for member, _ in self.groups:
                member.close()


    def cost(c):
        return c.step_s * (1 + c.settings.pull)  # made up, so a test can see it used


    INFO = StrategyInfo("pull", Pull, settings=PullSettings, by_seconds=True, waits_for_peers=False, cost=cost)
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "ravnest_pull_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    point = importlib.metadata.EntryPoint("pull", "ravnest_pull_plugin:INFO", registry.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda *, group: [point] if group == registry.ENTRY_POINT_GROUP else real(group=group))
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())  # what it loads is undone after


def test_an_installed_strategy_declares_its_settings_and_traits(plugin) -> None:
    assert "pull" in registry.available_strategies()
    settings = AveragingSettings.model_validate({"strategy": "pull", "every_seconds": 5, "pull": {"pull": 0.25}})
    assert settings.of("pull").pull == 0.25 and settings.model_dump()["pull"] == {"pull": 0.25}
    assert AveragingSettings(strategy="pull").of("pull").pull == 0.5  # its default
    with pytest.raises(ValueError, match=r"averaging.pull: pull: Input should be less than or equal to 1"):
        AveragingSettings.model_validate({"strategy": "pull", "pull": {"pull": 3}})
    with pytest.raises(ValueError, match=r"averaging.pull: strength: Extra inputs are not permitted"):
        AveragingSettings.model_validate({"strategy": "pull", "pull": {"strength": 3}})
    info = registry.strategy_info("pull")
    assert info.by_seconds and not info.waits_for_peers and not info.gossip
    group = Group(members=2, param_bytes=1e6, bandwidth=1e7, latency=1e-3)
    assert strategy_step_s("pull", 2.0, [group], settings=settings.of("pull")) == pytest.approx(2.5)


def test_an_installed_strategy_runs_in_training_with_the_jobs_settings(plugin) -> None:
    job = JobSpec.model_validate({
        "model": {"name": "mlp", "config": {"input_dim": 64, "hidden": 32, "depth": 2, "num_classes": 10}},
        "dataset": {"name": "digits"},
        "training": {"steps": 20, "batch_size": 16, "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-3}},
                     "eval_every": 0, "seed": 0},
        "averaging": {"strategy": "pull", "pull": {"pull": 0.25}}})
    results = run_threaded_clusters(job, [[(0, 2), (2, 4)], [(0, 2), (2, 4)]], timeout=120)
    for stage in range(2):
        a, b = (result["averagers"][stage] for result in results)
        assert a.pull == 0.25 and a.before_finish
        for key, after in a.live.items():
            if not after.is_floating_point():
                continue
            before_a, before_b = a.before_finish[key], b.before_finish[key]
            # each moved a quarter of the way to the mean: (1 - 0.25 / 2) of its own + 0.25 / 2 of the other's
            torch.testing.assert_close(after, 0.875 * before_a + 0.125 * before_b, rtol=1e-5, atol=1e-6)


def test_the_first_lookups_from_many_threads_at_once_all_find_the_built_ins(tmp_path, monkeypatch) -> None:
    """A restarted coordinator's first requests arrive together: before, one thread marked the
    built-ins imported before they were, and another was told 'unknown averaging strategy ring'."""
    import sys
    import threading

    from ravnest.plugins import PluginRegistry

    package = tmp_path / "slow_builtins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("alpha", "beta", "gamma"):  # each takes a while to import, then registers itself
        (package / f"{name}.py").write_text(textwrap.dedent(f"""
            import time
            import test_registry_holder
            time.sleep(0.1)
            test_registry_holder.REGISTRY.register({name!r}, object())
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    holder = type(sys)("test_registry_holder")
    holder.REGISTRY = PluginRegistry("ravnest.test-nothing", "thing", LookupError, package="slow_builtins")
    monkeypatch.setitem(sys.modules, "test_registry_holder", holder)
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(holder.REGISTRY.known("gamma"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert answers == [True] * 8
