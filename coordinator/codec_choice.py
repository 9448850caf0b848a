"""What codec `"auto"` sends with: on each pipeline link, and in the averaging between replicas. The
candidates are the registered codecs that declare `auto` for that use (ravnest/wire/codecs), least lossy
first; nothing here names one.

Pipeline links (`pick_codecs`): the precision's own codec (float32 as computed for fp32 jobs) wherever
the link moves a micro-batch's activations and gradients in under AUTO_LINK_SHARE of the slower end's
compute (the asynchronous pipeline hides the rest); else the least lossy candidate that sends fewer
bytes and fits, else the one that sends the fewest. With the built-ins: bf16.

Averaging (`averaging_codec`): the runtime model prices a step under each candidate (for diloco, which
averages changes, topk too); the least lossy one whose step is within AUTO_AVERAGING_SLACK of the
fastest wins: compress only where it pays (not where rounds keep up anyway, nor where latency, not
bytes, sets their pace).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ravnest.averaging import runtime
from ravnest.averaging.registry import AUTO, strategy_info
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity, compute_seconds
from ravnest.pipeline.precision import wire_codec
from ravnest.spec import AUTO_CODEC, AveragingSettings, TrainingSettings
from ravnest.wire import codecs

AUTO_LINK_SHARE = 0.5  # a link whose transfer at the precision's own codec takes longer than this share
                       # of its stages' compute is compressed
AUTO_AVERAGING_SLACK = 1.05  # compress averaging no further than what gains over 5% a step


def pick_codecs(merged: list[BlockCost], chain: list[NodeCapacity], training: TrainingSettings | None,
                ) -> list[str | None]:
    """Per stage, the codec on its link to the next stage (None on the last): the job's, or with
    `codec: "auto"` as the module docstring says."""
    asked, precision = (training.codec, training.precision) if training else ("", "fp32")
    plain = wire_codec(asked, precision)
    if asked != AUTO_CODEC:
        return [*[plain] * (len(merged) - 1), None]
    per_mib = {c.name: coded(1 << 20, c.name) for c in codecs.auto_candidates("pipeline")}
    options = [plain, *(name for name, size in per_mib.items() if size < coded(1 << 20, plain))]
    chosen: list[str | None] = []
    for s in range(len(merged) - 1):
        compute_s = max(compute_seconds(merged[s].flops, chain[s]),
                        compute_seconds(merged[s + 1].flops, chain[s + 1]))
        fits = [codec for codec in options if 2 * coded(merged[s].activation_bytes, codec)
                <= AUTO_LINK_SHARE * compute_s * chain[s].bandwidth_to_next]
        chosen.append(fits[0] if fits else min(options, key=lambda codec: coded(1 << 20, codec)))
    return [*chosen, None]


def coded_links(merged: list[BlockCost], link_codecs: list[str | None]) -> list[BlockCost]:
    """Each stage's profile with what its link to the next carries under that link's codec."""
    return [dataclasses.replace(m, activation_bytes=coded(m.activation_bytes, codec))
            for m, codec in zip(merged, link_codecs)]


def coded(activation_bytes: int, codec: str | None) -> int:
    """Bytes `codec` sends for float32 activations of `activation_bytes`."""
    return activation_bytes if not codec else codecs.codec(codec).wire_bytes(activation_bytes // 4)


def averaging_predictions(averaging: AveragingSettings, training: TrainingSettings, step_s: float,
                          groups: list[runtime.Group]) -> dict[str, float]:
    """The runtime model's seconds per step for each strategy `auto` may choose, and the reference."""
    return runtime.predictions(step_s, groups, every=averaging.every, optimizer=training.optimizer.name,
                               settings=averaging.of)


def averaging_candidates(averaging: AveragingSettings) -> list[str]:
    """What averaging codec "auto" chooses among, least lossy first (a shape is priced with the last)."""
    changes = averaging.strategy != AUTO and strategy_info(averaging.strategy).averages_changes
    return [c.name for c in codecs.auto_candidates("averaging", averages_changes=changes)]


def averaging_codec(averaging: AveragingSettings, training: TrainingSettings, step_s: float,
                    ring_groups: Callable[[str], list[runtime.Group]]) -> str:
    """Averaging codec "auto" (the module docstring)."""
    if averaging.strategy != AUTO and strategy_info(averaging.strategy).cost is None:
        return ""  # a plug-in the runtime model cannot price: no reason to compress
    predicted = {}
    for codec in averaging_candidates(averaging):
        predicted[codec] = min(averaging_predictions(averaging, training, step_s, ring_groups(codec)).values()) \
            if averaging.strategy == AUTO else runtime.strategy_step_s(
                averaging.strategy, step_s, ring_groups(codec), every=averaging.every, topology=averaging.topology,
                settings=averaging.of(averaging.strategy))
    fastest = min(predicted.values())
    return next(codec for codec, step in predicted.items() if step <= AUTO_AVERAGING_SLACK * fastest)
