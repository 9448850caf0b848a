"""The figures a stage reports (to the coordinator, and as Prometheus gauges on /metrics): their
meanings and their metric names. The node exports its stages' figures (node/exporter.py), the
coordinator every stage's latest report (coordinator/metrics.py); both name them the same way."""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from prometheus_client.core import GaugeMetricFamily

STAGE_FIGURES = {
    "step": "optimizer steps taken",
    "samples_per_s": "training samples per second since the stage started",
    "step_s": "mean seconds per optimizer step",
    "utilization": "share of wall time spent computing",
    "bubble": "share of wall time spent waiting",
    "staleness": "mean optimizer steps between a micro-batch's forward and its weight gradient",
    "in_flight": "micro-batches between forward and weight gradient (queue depth)",
    "memory_peak_bytes": "peak memory above idle",
    "loss": "training loss (last stage)",
    "test_accuracy": "test accuracy at the last evaluation (last stage)",
    "avg_rounds": "averaging rounds applied",
    "avg_round_s": "mean seconds per averaging round",
    "avg_stall_s": "seconds the training thread waited for averaging",
    "avg_round_bytes": "bytes a stage sent per averaging round, as its codec encoded them",
    "next_bytes_per_step": "bytes sent to the next stage per optimizer step (activations, as encoded)",
    "prev_bytes_per_step": "bytes sent to the previous stage per optimizer step (gradients, as encoded)",
    "next_link_busy": "share of time the stream to the next stage had something to send (1: the link sets the pace)",
    "prev_link_busy": "share of time the stream to the previous stage had something to send",
    "elapsed_s": "seconds since the stage started",
    "compute_s": "seconds spent computing per micro-batch, evaluation left out (the last 10 steps)",
    "step_wall_s": "wall seconds per optimizer step, evaluation left out (the last 10 steps)",
    "lr": "learning rate",
    "stage": "the stage's index in its pipeline",
    "test_loss": "test loss at the last evaluation (last stage)",
    "training_alone": "1 while the stage trains alone (its averaging failed; the job is re-planned)",
    "tokens_per_s": "training tokens per second since the stage started (language models)",
    "model_flops_per_s": "the stage's model FLOPs per second: 3x its blocks' forward FLOPs per sample, times samples/s",
    "mfu": "model FLOPs utilization: model_flops_per_s over the GPU's 16-bit peak (where known)",
    "steady_utilization": "share of wall time spent computing, 20%-90% of the steps (final report)",
    "steady_samples_per_s": "training samples per second, 20%-90% of the steps (final report)",
    "steady_step_sd_s": "spread of single steps' wall times, 20%-90% of the steps (final report)",
    "audits_passed": "spot checks of the stage's input judged fine (robust jobs, stages after the first)",
}
STRATEGY_FIGURE = re.compile(r"avg_[a-z0-9_]{1,40}")  # an averaging strategy's own figures
MAX_FIGURES = 64  # figures in one report; a stage sends about 25


def is_stage_figure(name: str) -> bool:
    """Whether the coordinator keeps a reported figure: those above and a strategy's own `avg_*`
    (others, e.g. from a newer node, are dropped, so a report cannot grow a job's record)."""
    return name in STAGE_FIGURES or STRATEGY_FIGURE.fullmatch(name) is not None


def stage_metric(figure: str) -> tuple[str, str]:
    """(Prometheus name, help text) of a stage figure; figures without a description still export."""
    return ("ravnest_stage_" + re.sub(r"[^a-zA-Z0-9_]", "_", figure),
            STAGE_FIGURES.get(figure, f"the stage's {figure.replace('_', ' ')}"))


def stage_gauges(labels: Sequence[str], stages: Iterable[tuple[Sequence[str], dict[str, float]]]
                 ) -> list[GaugeMetricFamily]:
    """One gauge family per figure over `stages`, pairs of (label values, the stage's figures)."""
    families: dict[str, GaugeMetricFamily] = {}
    for values, figures in stages:
        for figure, value in sorted(figures.items()):
            if figure == "stage":
                continue  # a label already
            if figure not in families:
                families[figure] = GaugeMetricFamily(*stage_metric(figure), labels=list(labels))
            families[figure].add_metric(list(values), float(value))
    return list(families.values())
