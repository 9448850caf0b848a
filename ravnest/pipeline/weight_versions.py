"""The weight versions a stage keeps: one snapshot of the parameters per version that still has
micro-batches in flight, so a backward uses exactly the weights its forward used; and, for staleness
compensation, forwards on weights predicted a few updates ahead (stash.py uses them)."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]


class WeightVersions:
    """Reference-counted parameter snapshots, one per (weight version, lookahead) with micro-batches in
    flight.

    With `snapshots=False` every version is the live parameters themselves: right when no optimizer
    step can fall between a micro-batch's forward and its backward, and it saves a parameter-sized
    copy. With `predict` (the order), a forward that will be d = `lookahead` updates stale uses the
    weights extrapolated that far (weight prediction, as SpecTrain and XPipe: the gradient is then
    taken near the weights it will be applied to). From w and the weights before the last two steps,
    w1 (`previous`) and w2 (`earlier`), order 1 extrapolates along the last update and order 2 along
    its change too (the second-order polynomial through the three versions):

        order 1:  w + d (w - w1)                                     = lerp(w1, w, 1 + d)
        order 2:  w + d (w - w1) + c ((w - w1) - (w1 - w2)), c = d (d + 1) / 2
                  = lerp(lerp(w2, w1, (d + 2c) / (d + c)), w, 1 + d + c)       (3 w - 3 w1 + w2 at d = 1)

    `previous` is a copy taken before each optimizer step; order 2 rotates the two buffers, so it
    copies no more per step: predicting costs one parameter copy per step over plain snapshots, order
    2 one more buffer and one more pass per prediction. The copy may be taken early (`save_previous`),
    anywhere after the version's forwards have acquired their weights: by the version's last forward
    itself (`acquire(..., last=True)`), which copies each piece of the weights while the prediction
    has it in cache (the buffer it overwrites is read first, piece by piece), or while the stage
    waits for a gradient. Whatever else moves the live weights (an averaging correction) must move
    the earlier weights alike (`history`): a correction is not an update to extrapolate."""

    def __init__(self, module: nn.Module, snapshots: bool = True, predict: int = 0):
        self.snapshots = snapshots
        self._live: Tensors = dict(module.named_parameters())
        self._snapshots: dict[tuple[int, int], Tensors] = {}
        self._users: Counter[tuple[int, int]] = Counter()
        self._spare: list[Tensors] = []  # retired snapshots, refilled in place: no allocation per step
        self.predict = int(predict) if snapshots else 0
        # the weights before the last optimizer step; none before the first (nothing to extrapolate:
        # a stage resuming from a checkpoint loads its weights after this is built)
        self.previous: Tensors | None = None
        self.earlier: Tensors | None = None  # order 2: the weights before the step before it
        self._previous_saved = False  # `previous` holds the weights the next step starts from
        self.current = 0

    @torch.no_grad()
    def acquire(self, lookahead: int = 0, last: bool = False) -> tuple[int, Tensors]:
        """The current version's weights (predicted `lookahead` updates on when predicting), taken on
        first use and held until `release` with the same lookahead. `last`: no other forward acquires
        weights before the next optimizer step, so the prediction may take that step's copy too."""
        if not self.snapshots:
            return self.current, self._live
        key = self._key(self.current, lookahead)
        lookahead = key[1]
        snapshot = self._snapshots.get(key)
        if snapshot is None:
            snapshot = self._spare.pop() if self._spare else {
                name: torch.empty_like(p).requires_grad_(p.requires_grad) for name, p in self._live.items()}
            if lookahead and self.previous is not None:
                self._predict(snapshot, lookahead, save=last and not self._previous_saved)
            else:
                torch._foreach_copy_(list(snapshot.values()), list(self._live.values()))
            self._snapshots[key] = snapshot
        self._users[key] += 1
        return self.current, snapshot

    def _predict(self, snapshot: Tensors, d: int, save: bool) -> None:
        """The weights extrapolated d updates on (the class docstring) into `snapshot`, piece by piece
        (PIECE values of each tensor at a time: what a piece's passes touch stays in cache); with `save`,
        also the copy of the live weights the next step needs (`save_previous`), into the buffer
        whose piece the prediction has just read."""
        previous, earlier = self.previous, self.earlier
        assert previous is not None  # (`acquire` predicts only once there is one)
        copy_to = self._copy_target() if save else {}
        c = d * (d + 1) / 2
        second = earlier is not None
        for name, p in self._live.items():
            tensors = [snapshot[name], p.detach(), previous[name]]
            tensors += ([earlier[name]] if earlier is not None else []) + ([copy_to[name]] if save else [])
            for out, w, w1, *rest in zip(*_pieces(tensors)):
                if second:  # order 2
                    torch.lerp(rest[0], w1, (d + 2 * c) / (d + c), out=out)
                    torch.lerp(out, w, 1.0 + d + c, out=out)
                else:
                    torch.lerp(w1, w, 1.0 + d, out=out)
                if save:
                    rest[-1].copy_(w)
        if save:
            self._copied()

    def release(self, version: int, lookahead: int = 0) -> None:
        if not self.snapshots:
            return
        key = self._key(version, lookahead)
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            if version != self.current:
                self._retire(key)

    def _key(self, version: int, lookahead: int) -> tuple[int, int]:
        return version, (lookahead if self.predict else 0)  # no prediction: one per version

    @torch.no_grad()
    def save_previous(self) -> None:
        """Copy the live weights into `previous` now, for the coming step, unless done already; the
        live weights must change only by corrections (which move `previous` too) until that step."""
        if not self.predict or self._previous_saved:
            return
        if self.previous is None:
            self.previous = {name: p.detach().clone() for name, p in self._live.items()}
            self._previous_saved = True
            return
        torch._foreach_copy_(list(self._copy_target().values()), [p.detach() for p in self._live.values()])
        self._copied()

    def _copy_target(self) -> Tensors:
        """The buffer the coming step's copy goes into: order 1 its one buffer, order 2 the older of its
        two (made on the first copy into it), which then becomes `previous` (`_copied`)."""
        assert self.previous is not None  # (`save_previous` makes it at the first step)
        if self.predict == 1:
            return self.previous
        if self.earlier is None:
            self.earlier = {name: torch.empty_like(p) for name, p in self.previous.items()}
        return self.earlier

    def _copied(self) -> None:
        if self.predict > 1:
            self.previous, self.earlier = self.earlier, self.previous
        self._previous_saved = True

    def history(self) -> list[Tensors]:
        """The earlier weights a prediction extrapolates from (none without prediction)."""
        return [weights for weights in (self.previous, self.earlier) if weights is not None]

    def before_step(self) -> None:
        self.save_previous()
        self._previous_saved = False  # the step changes the weights: the next one copies again

    def advance(self) -> None:
        """The optimizer stepped: later forwards use a new version; retire the old ones if unused."""
        for key in [key for key in self._snapshots if key[0] == self.current and not self._users[key]]:
            self._users.pop(key, None)
            self._retire(key)
        self.current += 1

    def _retire(self, key: tuple[int, int]) -> None:
        # Its micro-batches are all done, so no autograd graph still holds these tensors.
        snapshot = self._snapshots.pop(key, None)
        if snapshot is not None:
            self._spare.append(snapshot)

    def __len__(self) -> int:
        return len(self._snapshots)


PIECE = 1 << 18  # values: a piece's four tensors (4 MiB) stay in cache between its passes; fastest of 32K-1M


def _pieces(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Each tensor cut into the same flat PIECE-value views (whole, unless all are contiguous)."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(-1).split(PIECE) for t in tensors]
    return [(t,) for t in tensors]
