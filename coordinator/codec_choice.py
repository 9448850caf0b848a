"""What codec `"auto"` sends with: on each pipeline link, and in the averaging between replicas. The
candidates are the registered codecs that declare `auto` for that use (ravnest/wire/codecs), least lossy
first; nothing here names one.

Pipeline links (`pick_codecs`): the precision's own codec (float32 as computed for fp32 jobs) wherever
the link moves a micro-batch's activations and gradients in under AUTO_LINK_SHARE of the slower end's
compute (the asynchronous pipeline hides the rest); else the least lossy candidate that sends fewer
bytes and fits, else the one that sends the fewest. With the built-ins: fp32 -> bf16 -> q8 -> q4 -> q4g3 -> q3,
each fewer bytes than the one before (ravnest/wire/codecs/blockwise.py). A model gets no codec
lossier than `lossiest_codec(model)`: what bench.codec_cost measured within LOSS_BOUND of float32's
held-out loss for it (docs/links.md); bf16 for a model not measured.

Averaging (`averaging_codec`): the runtime model prices a step under each candidate (for diloco, which
averages changes, topk too); the least lossy one whose step is within AUTO_AVERAGING_SLACK of the
fastest wins: compress only where it pays (not where rounds keep up anyway, nor where latency, not
bytes, sets their pace).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from ravnest.averaging import runtime
from ravnest.averaging.registry import AUTO, strategy_info
from ravnest.models import ModelSpec
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity, compute_seconds
from ravnest.pipeline.precision import wire_codec
from ravnest.spec import AUTO_CODEC, AveragingSettings, TrainingSettings
from ravnest.wire import codecs

AUTO_LINK_SHARE = 0.5  # a link whose transfer at the precision's own codec takes longer than this share
                       # of its stages' compute is compressed
AUTO_AVERAGING_SLACK = 1.05  # compress averaging no further than what gains over 5% a step
LOSS_BOUND = 0.02  # the held-out loss a pipeline codec may cost against float32 (relative, at the same step)
# The lossiest pipeline codec `auto` may pick per model: bench.codec_cost's measurement against LOSS_BOUND
# (docs/links.md, "What each codec costs in learning"). A model not listed gets UNMEASURED.
MEASURED_WITHIN_BOUND = {"gpt": "q3", "llama": "q4g3"}  # (q3 both ways cost a fine-tuned llama 2.9%)
UNMEASURED = "bf16"


def lossiest_codec(model: ModelSpec) -> str:
    """The lossiest pipeline codec `auto` may pick for this model (the module docstring); bf16 where what
    crosses a cut must arrive exactly (its exactness holds to bf16)."""
    return "bf16" if model.exact_links else MEASURED_WITHIN_BOUND.get(model.name, UNMEASURED)


def lossier_than(codec: str, lossiest: str) -> bool:
    """Whether `codec` loses more on a pipeline link than `lossiest` does (by their `auto` ranks)."""
    return codecs.codec(codec).auto.get("pipeline", 0) > codecs.codec(lossiest).auto.get("pipeline", 0)


def pick_codecs(merged: list[BlockCost], chain: list[NodeCapacity], training: TrainingSettings | None, *,
                lossiest: str | None = None, why: list[str] | None = None) -> list[str | None]:
    """Per stage, the codec on its link to the next stage (None on the last): the job's, or with
    `codec: "auto"` as the module docstring says, none lossier than `lossiest` (None: any). With
    `why`, a line per link on what it got and why is added to it."""
    asked, precision = (training.codec, training.precision) if training else ("", "fp32")
    plain = wire_codec(asked, precision)
    if asked != AUTO_CODEC:
        return [*[plain] * (len(merged) - 1), None]
    limit = codecs.codec(lossiest).auto.get("pipeline", 0) if lossiest is not None else math.inf
    options = [plain, *(c.name for c in codecs.auto_candidates("pipeline")
                        if c.auto["pipeline"] <= limit and coded(1 << 20, c.name) < coded(1 << 20, plain))]
    chosen: list[str | None] = []
    for s in range(len(merged) - 1):
        compute_s = max(compute_seconds(merged[s].flops, chain[s]),
                        compute_seconds(merged[s + 1].flops, chain[s + 1]))
        share = {codec: 2 * coded(merged[s].activation_bytes, codec) / chain[s].bandwidth_to_next / compute_s
                 for codec in options}  # the link's seconds per micro-batch over its stages' compute
        fits = [codec for codec in options if share[codec] <= AUTO_LINK_SHARE]
        picked = fits[0] if fits else min(options, key=lambda codec: coded(1 << 20, codec))
        chosen.append(picked)
        if why is not None and (reason := _link_reason(s, picked, share, options, lossiest)):
            why.append(reason)
    return [*chosen, None]


def _link_reason(s: int, codec: str, share: dict[str, float], options: list[str], lossiest: str | None) -> str:
    """'link 1->2 sends q8: its transfer would take 1.3x its stages' compute in float32, 0.65x in bf16,
    0.33x in q8 (auto compresses past 0.5x)'; nothing for a link left as it is."""
    if codec == options[0]:
        return ""
    first, *rest = options[:options.index(codec) + 1]
    tried = ", ".join([f"{share[first]:.2g}x its stages' compute in {first or 'float32'}",
                       *(f"{share[c]:.2g}x in {c}" for c in rest)])
    limited = ", the lossiest codec measured for this model" if share[codec] > AUTO_LINK_SHARE and lossiest else ""
    return f"link {s}->{s + 1} sends {codec}: its transfer would take {tried}{limited} (auto compresses past " \
           f"{AUTO_LINK_SHARE:g}x)"


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
