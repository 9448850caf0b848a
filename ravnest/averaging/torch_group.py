"""The group collectives over torch.distributed's gloo, for trusted clusters (`averaging.backend: "torch"`).

Same interface and results as `RingMember` (the strategies cannot tell them apart): `allreduce`,
`reduce_scatter` + `all_gather`, and gossip's `exchange`, on flat fp32 CPU vectors, every member
calling the same collectives in the same order. Each segment gets its own gloo process group,
built at its first collective: member 0 opens a TCPStore on its own host and sends the port to the
others over the authenticated peer wire (the only message this backend sends there), then gloo
connects the members directly.

gloo and the TCPStore bring NO authentication and NO encryption: whoever reaches those ports can
join the group, read every tensor or corrupt the average. Use this backend only where every machine
on the network is trusted (a LAN, a datacenter); gRPC (`backend: "grpc"`, the default) is the only
choice across the internet. On CUDA nodes the vectors are still CPU tensors here, so gloo is used
there too (NCCL would need them on the GPU).
"""
from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from ravnest.averaging.collectives import RingError, RingMember, _work_buffer
from ravnest.wire import Router

RENDEZVOUS_ROUND = 0  # the wire round carrying the store's port (the wire member is used for nothing else)


class TorchMember:
    """This node's place in one segment's gloo group; see the module docstring."""

    def __init__(self, rank: int, addresses: list[str], router: Router, token: str | None = None, *,
                 segment: int = 0, step_timeout: float = 60.0, **_ring_options):
        self.rank, self.size, self.segment = rank, len(addresses), segment
        self.addresses = list(addresses)
        self.step_timeout = step_timeout
        self._wire = RingMember(rank, addresses, router, token, segment=segment, step_timeout=step_timeout)
        self._group: ProcessGroupGloo | None = None
        self._store: TCPStore | None = None
        self._closed = threading.Event()

    # --- the collectives (RingMember's signatures; `round` and `codec` have no use here) ---------

    def allreduce(self, flat: torch.Tensor, round: int, *, codec: str | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        buf = _work_buffer(flat, out)
        self._wait(self._pg().allreduce([buf]))
        return buf.div_(self.size)

    def reduce_scatter(self, flat: torch.Tensor, round: int, *, codec: str | None = None,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """Member r ends with the mean of share r in its buffer; gloo reduces equal chunks, so the
        vector is padded to a multiple of the group size."""
        buf = _work_buffer(flat, out)
        chunk = -(-buf.numel() // self.size)
        padded = torch.zeros(chunk * self.size)
        padded[:buf.numel()] = buf
        mine = torch.empty(chunk)
        self._wait(self._pg().reduce_scatter([mine], [list(padded.split(chunk))]))
        a, b = self.owned_share(buf.numel())
        buf[a:b] = mine[:b - a].div_(self.size)
        return buf, (a, b)

    def all_gather(self, buf: torch.Tensor, round: int, *, codec: str | None = None) -> torch.Tensor:
        chunk = -(-buf.numel() // self.size)
        a, b = self.owned_share(buf.numel())
        mine = torch.zeros(chunk)
        mine[:b - a] = buf[a:b]
        gathered = [torch.empty(chunk) for _ in range(self.size)]
        self._wait(self._pg().allgather([gathered], [mine]))
        buf.copy_(torch.cat(gathered)[:buf.numel()])
        return buf

    def exchange(self, flat: torch.Tensor, round: int, sends_to: list[int], hears_from: list[int], *,
                 codec: str | None = None, paced: bool = False) -> dict[int, torch.Tensor]:
        """RingMember.exchange over gloo; `paced` is accepted and ignored (gloo schedules its own transfers)."""
        flat = flat.detach().reshape(-1).to(torch.float32).contiguous()
        received = {source: torch.empty(flat.numel()) for source in hears_from}
        group = self._pg()
        tag = round % (1 << 30)
        works = [group.send([flat], target, tag) for target in sends_to]
        works += [group.recv([received[source]], source, tag) for source in hears_from]
        for work in works:
            self._wait(work)
        return received

    def owned_share(self, numel: int) -> tuple[int, int]:
        """Share r of the vector, in gloo's equal chunks (the last one shorter)."""
        chunk = -(-numel // self.size)
        return min(numel, self.rank * chunk), min(numel, (self.rank + 1) * chunk)

    def close(self) -> None:
        """Leave the group; a collective still running fails (gloo aborts its pairs)."""
        self._closed.set()
        self._wire.close()
        if self._group is not None:
            self._group.abort()

    # --- internals ------------------------------------------------------------------------------

    def _pg(self) -> Any:  # a ProcessGroupGloo: torch's stubs do not list the collectives it binds
        if self._closed.is_set():
            raise RingError(f"segment {self.segment}: this member left the group")
        if self._group is None:
            timeout = datetime.timedelta(seconds=self.step_timeout)
            host = self.addresses[self.rank].rpartition(":")[0].strip("[]")
            if self.rank == 0:
                self._store = TCPStore(host, 0, self.size, is_master=True, timeout=timeout, wait_for_workers=False)
                self._wire.exchange(torch.tensor([float(self._store.port)]), RENDEZVOUS_ROUND,
                                    sends_to=list(range(1, self.size)), hears_from=[])
            else:
                port = int(self._wire.exchange(torch.zeros(1), RENDEZVOUS_ROUND, sends_to=[],
                                               hears_from=[0])[0][0])
                master = self.addresses[0].rpartition(":")[0].strip("[]")
                self._store = TCPStore(master, port, self.size, is_master=False, timeout=timeout)
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (bound in C++)
            options._devices = [ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            self._group = ProcessGroupGloo(PrefixStore(f"ravnest-segment-{self.segment}", self._store),
                                           self.rank, self.size, options)
        return self._group

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RingError(f"segment {self.segment}: gloo collective failed on member {self.rank}: {e}") from e
