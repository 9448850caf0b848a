"""The coordinator's Prometheus metrics (GET /metrics, any API key): read from the store at scrape time.

    ravnest_nodes{state}                       nodes idle, busy, gone
    ravnest_jobs{state}                        jobs per state
    ravnest_job_<figure>{job}                  an active job's progress_ratio, loss, test_accuracy,
                                               samples_per_s, tokens_per_s, mfu, step_s, utilization,
                                               bubble, staleness,
                                               averaging_round_s, averaging_rounds, generation
    ravnest_stage_<figure>{job,cluster,stage,node}
                                               each stage's latest report (as the node exports it)
    ravnest_db_seconds_total                   time this process waited on database statements
plus the coordinator process's own (memory, CPU, open files).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ravnest.telemetry import stage_gauges

if TYPE_CHECKING:
    from .service.lifecycle import JobLifecycle
    from .service.membership import Membership

JOB_FIGURES = {
    "loss": "mean of the clusters' last-stage training loss",
    "test_accuracy": "test accuracy at the last evaluation",
    "samples_per_s": "training samples per second, summed over clusters",
    "tokens_per_s": "a language model's training tokens per second, summed over clusters",
    "mfu": "model FLOPs utilization over the stages' GPU peaks",
    "step_s": "seconds per optimizer step, slowest cluster",
    "utilization": "share of wall time the stages spend computing (mean)",
    "bubble": "share of wall time the stages spend waiting (mean)",
    "staleness": "mean optimizer steps between a micro-batch's forward and its weight gradient",
    "averaging_round_s": "mean seconds per averaging round",
    "averaging_rounds": "averaging rounds applied (fewest over the stages)",
}


class CoordinatorFigures(Collector):
    def __init__(self, membership: Membership, jobs: JobLifecycle, owner: str | None) -> None:
        self.membership, self.jobs, self.owner = membership, jobs, owner  # owner: a submitter sees its own jobs

    def collect(self):
        by_state = GaugeMetricFamily("ravnest_nodes", "nodes known to the coordinator", labels=["state"])
        for state, count in self.membership.presence.count_by_state().items():
            by_state.add_metric([state], count)
        yield by_state
        yield CounterMetricFamily("ravnest_db_seconds", "seconds this process waited on database statements",
                                  value=self.membership.core.store.db_seconds)
        summaries, _ = self.jobs.list_jobs(self.owner)
        jobs = GaugeMetricFamily("ravnest_jobs", "jobs per state", labels=["state"])
        for state in sorted({j.state for j in summaries} | {"pending", "running", "completed", "failed"}):
            jobs.add_metric([state], sum(j.state == state for j in summaries))
        yield jobs
        job_families = {name: GaugeMetricFamily(f"ravnest_job_{name}", text, labels=["job"])
                        for name, text in {**JOB_FIGURES, "progress_ratio": "share of the steps done",
                                           "generation": "re-plans so far"}.items()}
        stages = []
        for summary in summaries:
            if summary.state not in ("running", "recovering"):
                continue
            view = self.jobs.get_job(summary.id, self.owner)
            job_families["progress_ratio"].add_metric([view.id], view.progress.fraction)
            job_families["generation"].add_metric([view.id], view.generation)
            for name in JOB_FIGURES:
                value = getattr(view.metrics, name)
                if value is not None:
                    job_families[name].add_metric([view.id], value)
            stages += [((view.id, str(stage.cluster), str(stage.stage), stage.node_id), stage.metrics)
                       for stage in view.metrics.stages]
        yield from job_families.values()
        yield from stage_gauges(["job", "cluster", "stage", "node"], stages)


PROCESS = ProcessCollector(registry=None)  # this process's memory, CPU and files, in every scrape


def scrape(membership: Membership, jobs: JobLifecycle, owner: str | None) -> bytes:
    """The Prometheus text exposition for one request (a registry per scrape: its jobs are the caller's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PROCESS)
    registry.register(CoordinatorFigures(membership, jobs, owner))
    return generate_latest(registry)
