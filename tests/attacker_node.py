"""A volunteer who lies, as a real `ravnest-node` process: `python -m tests.attacker_node join ...` takes
the flags of `ravnest-node join` and runs it with lies patched in.

- With `--attack NAME` (tests/attacks.py; `--attack-from-round R`: honest before averaging round R,
  `--attack-every E`: the job's steps between rounds), it runs that attack and nothing else.
- Without one it tells two lies: it claims a link of CLAIMED_BANDWIDTH B/s (what `ravnest-node`
  measured of its link is thrown away), and every ring chunk it sends holds NaN.

Its training, pipeline streams and reports are otherwise an honest node's. Only tests and
bench.byzantine run it."""
import argparse
import functools
import sys

import torch

import node.daemon
from node.cli import main
import ravnest.averaging.strategies.ring as ring_strategy
from ravnest.averaging.collectives import RingMember
from ravnest.data.datasets import Dataset
from ravnest.pipeline.executor import StageExecutor
from tests.attacks import ATTACKS, Attack

CLAIMED_BANDWIDTH = 1e11  # bytes/s: 10x more than loopback carries here (1e9), within what a profile may say


def _claiming_a_fast_link(profile_node):
    def profile(*args, **kwargs):
        return profile_node(*args, **kwargs).model_copy(update={"bandwidth_bytes_per_s": CLAIMED_BANDWIDTH})
    return profile


def _poisoning(send):
    def poisoned(self, round, step, chunk, part, *args, **kwargs):
        return send(self, round, step, chunk, torch.full_like(part, float("nan")), *args, **kwargs)
    return poisoned


def install(attack: Attack) -> None:
    """Patch this process's node code so it runs `attack` (tests/attacks.py)."""
    plain, robust = RingMember.allreduce, ring_strategy.robust_allreduce  # what the ring strategy calls

    def lying(member, flat, round, *args, _honest=plain, **kwargs):
        return _honest(member, attack.contribution(flat, round, member.segment), round, *args, **kwargs)
    RingMember.allreduce = lying  # type: ignore[method-assign]
    ring_strategy.robust_allreduce = functools.partial(lying, _honest=robust)

    batches = Dataset.batches

    def flipped(self, batch_size, seed):
        for count, (x, y) in enumerate(batches(self, batch_size, seed)):
            yield x, attack.labels(y, self.num_classes or 1, count // attack.every)
    Dataset.batches = flipped  # type: ignore[method-assign]

    send_forward, send_backward = StageExecutor._send_forward, StageExecutor._send_backward

    def garbage_forward(self, m):
        self._output = attack.activations(self._output, self.optimizer.steps // attack.every)
        return send_forward(self, m)

    def garbage_backward(self, m):
        self._input_grad = attack.activations(self._input_grad, self.optimizer.steps // attack.every)
        return send_backward(self, m)
    StageExecutor._send_forward = garbage_forward  # type: ignore[method-assign]
    StageExecutor._send_backward = garbage_backward  # type: ignore[method-assign]


def _split(argv: list[str]) -> tuple[Attack | None, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--attack", choices=ATTACKS)
    parser.add_argument("--attack-from-round", type=int, default=0)
    parser.add_argument("--attack-every", type=int, default=1)
    ours, rest = parser.parse_known_args(argv)
    return (Attack(ours.attack, ours.attack_from_round, ours.attack_every) if ours.attack else None), rest


if __name__ == "__main__":
    chosen, sys.argv[1:] = _split(sys.argv[1:])
    if chosen is None:
        node.daemon.profile_node = _claiming_a_fast_link(node.daemon.profile_node)
        RingMember._send = _poisoning(RingMember._send)  # type: ignore[method-assign]
    else:
        install(chosen)
    sys.exit(main())
