"""Strategy "dadam": decentralized Adam ("From promise to practice", arXiv 2410.11998): the gossip
mixing of "dsgd" with an Adam-type local step. Choose the optimizer in the job's training settings;
AccumAdam / AccumAdamW (`ravnest/pipeline/accum_adam.py`), whose moments advance with the gradient
averaged over several steps, are made for it."""
from __future__ import annotations

from ravnest.averaging.strategies.dsgd import GossipMixing, gossip_cost
from ravnest.averaging.strategy import register_strategy


@register_strategy("dadam", gossip=True, cost=gossip_cost, auto_rank=2, robust=True,
                   fits=lambda optimizer: "adam" in optimizer.lower())
class DecentralizedAdam(GossipMixing):
    name = "dadam"
