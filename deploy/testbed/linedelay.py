"""A home line's round trip, jitter and loss, packet by packet: what netem would do, where it is missing.

Runs inside a member's line namespace (rvn-d<i>, made by netns.sh), which holds two bridges: `lan`
(the veth to the member, or to its NAT router, and the tap `tl`) and `wan` (the veth to the hub's
bridge and the tap `tw`). Every Ethernet frame the kernel hands to one tap is held for its one-way
delay and written into the other, so TCP itself sees the round trip: its window growth, its loss
recovery and the bandwidth-delay product behave as on a long line, which a delaying forwarder would
hide. Standard library only (it runs as root under `ip netns exec`, outside any virtualenv).

A frame waits half the round trip plus the line's current jitter, uniform in +-jitter/2 and drawn
afresh every JITTER_PERIOD (as a queue's delay on the way wanders), so a round trip through the line
varies by up to +-jitter and averages what was asked. Frames leave in the order they came: a line's
queue does not reorder, and netem's per-frame jitter reorders, which TCP takes for loss (and keeping
per-frame draws in order would lengthen the mean delay). Each frame is dropped with the
loss probability. At most --max-bytes wait per direction; beyond that frames are dropped, as a full
router queue drops them. The taps carry whole frames: without TUNSETOFFLOAD a tap offers no TSO or
checksum offload, so the kernel segments and checksums before handing a frame over.

    ip netns exec rvn-d0 python3 deploy/testbed/linedelay.py --rtt-ms 100 --jitter-ms 10 --loss 0.001

SIGHUP rereads the --settings file (one line: "RTT_MS JITTER_MS LOSS"), so a line can change under
a running job; SIGTERM ends it and, with --stats, writes the CPU seconds it used and frames it moved.
"""
from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import resource
import select
import signal
import struct
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
FRAME_MAX = 65536
JITTER_PERIOD = 0.02  # seconds


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Line:
    """Both directions of one line: frames read from one tap wait, then go out of the other."""

    def __init__(self, rtt_ms: float, jitter_ms: float, loss: float, max_bytes: int, seed: int):
        self.max_bytes, self.random = max_bytes, random.Random(seed)
        self.set(rtt_ms, jitter_ms, loss)
        self.waiting: list[tuple[float, int, int, bytes]] = []  # (release time, order, out fd, frame)
        self.held = {}  # out fd -> bytes waiting
        self.last = {}  # out fd -> the latest release time given (frames keep their order)
        self.order = 0
        self.offset, self.drawn = 0.0, float("-inf")  # the current jitter, and when it was drawn
        self.moved = self.dropped = 0

    def set(self, rtt_ms: float, jitter_ms: float, loss: float) -> None:
        if rtt_ms < 0 or jitter_ms < 0 or not 0 <= loss < 1 or jitter_ms > rtt_ms:
            raise ValueError(f"a line needs rtt >= jitter >= 0 and 0 <= loss < 1 "
                             f"(got rtt {rtt_ms} ms, jitter {jitter_ms} ms, loss {loss})")
        self.one_way, self.jitter, self.loss = rtt_ms / 2000, jitter_ms / 2000, loss

    def take(self, frame: bytes, out: int, now: float) -> None:
        if self.loss and self.random.random() < self.loss or self.held.get(out, 0) + len(frame) > self.max_bytes:
            self.dropped += 1
            return
        if now - self.drawn >= JITTER_PERIOD:
            self.offset, self.drawn = self.random.uniform(-self.jitter, self.jitter) if self.jitter else 0.0, now
        release = max(now + self.one_way + self.offset, self.last.get(out, 0.0))
        self.last[out] = release
        self.held[out] = self.held.get(out, 0) + len(frame)
        self.order += 1
        heapq.heappush(self.waiting, (release, self.order, out, frame))

    def release(self, now: float) -> float | None:
        """Write every frame that is due; seconds until the next one, or None when none waits."""
        while self.waiting and self.waiting[0][0] <= now:
            _, _, out, frame = heapq.heappop(self.waiting)
            self.held[out] -= len(frame)
            try:
                os.write(out, frame)
                self.moved += 1
            except BlockingIOError:
                self.dropped += 1
        return self.waiting[0][0] - now if self.waiting else None


def read_settings(path: str) -> tuple[float, float, float]:
    rtt, jitter, loss = open(path).read().split()
    return float(rtt), float(jitter), float(loss)


def run(args: argparse.Namespace) -> None:
    lan, wan = open_tap(args.lan_tap), open_tap(args.wan_tap)
    other = {lan: wan, wan: lan}
    line = Line(args.rtt_ms, args.jitter_ms, args.loss, args.max_bytes, args.seed)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    def reread(*_):
        if args.settings:
            try:
                line.set(*read_settings(args.settings))
            except (OSError, ValueError) as exc:
                print(f"linedelay: kept the line as it was: {exc}", flush=True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reread)
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
    wait = None
    while not stopping:
        try:
            readable, _, _ = select.select([lan, wan], [], [], wait)
        except InterruptedError:
            readable = []
        now = time.monotonic()
        for fd in readable:
            while True:  # everything the tap has now: one wake-up for a burst
                try:
                    frame = os.read(fd, FRAME_MAX)
                except BlockingIOError:
                    break
                except OSError:  # the namespace and its taps are gone
                    stopping = True
                    break
                line.take(frame, other[fd], now)
        wait = line.release(time.monotonic())
    if args.stats:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        with open(args.stats, "w") as f:
            json.dump({"cpu_s": usage.ru_utime + usage.ru_stime, "frames": line.moved, "dropped": line.dropped}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", type=float, required=True, help="round trip the line adds (half each way)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="a round trip varies by up to +- this")
    p.add_argument("--loss", type=float, default=0.0, help="probability a frame is dropped, each way")
    p.add_argument("--lan-tap", default="tl")
    p.add_argument("--wan-tap", default="tw")
    p.add_argument("--max-bytes", type=int, default=16 << 20, help="bytes that may wait, each way")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settings", help="file of 'RTT_MS JITTER_MS LOSS' reread on SIGHUP")
    p.add_argument("--pidfile")
    p.add_argument("--stats", help="file for CPU seconds and frames, written at exit")
    args = p.parse_args()
    try:
        Line(args.rtt_ms, args.jitter_ms, args.loss, args.max_bytes, args.seed)
    except ValueError as exc:
        p.error(str(exc))
    run(args)


if __name__ == "__main__":
    main()
