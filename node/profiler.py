"""What a node measures about itself before joining: compute, memory, device, link to the coordinator."""
from __future__ import annotations

import os
import random
import re
import statistics
import threading
import time

from collections.abc import Mapping

import httpx
import torch

from node.progress import Progress
from ravnest.client.api import ApiError, refusal_reason
from ravnest.pipeline.memory import status_bytes
from ravnest.spec import LATENCY, SPREAD, NodeProfile, plausible_bandwidth
from ravnest.wire.transport.probes import PINGS, LinkFigures, growing_probe


def pick_device(choice: str = "auto") -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(choice)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but CUDA is not available on this machine")
    return device


def matmul_flops(device: torch.device, size: int = 512, seconds: float = 0.3, window: float = 0.008,
                 probes: int = 5) -> float:
    """Peak fp32 matmul FLOP/s: the figure the planner divides block FLOPs by, measuring the hardware,
    not the moment: load that comes and goes on the machine (its owner's, other nodes profiling or
    training beside it) must not mark a node slow for good. So each of `probes` probes takes the best
    of its short windows, not their mean, and the figure is the probes' median: one lucky window (a
    turbo burst) or one unlucky probe does not decide it. A single-threaded node on a CPU times them
    by its CPU time, which is the time it computed whatever else runs (3 busy loops on 2 cores: 96
    GFLOP/s against 101 idle; the best wall-clock window said 63, and nodes joining beside training
    ones looked too slow to grow a job onto). With several threads, wall time: a descheduled thread
    stalls the rest, which CPU time would not see. What a node then computes like in real stages is
    measured during its jobs (coordinator/calibration.py)."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up (kernel selection, lazy init)
    _sync(device)
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    return statistics.median(_best_window(a, b, clock, seconds / probes, window) for _ in range(probes))


def _best_window(a: torch.Tensor, b: torch.Tensor, clock, seconds: float, window: float) -> float:
    """The fastest FLOP/s of `a @ b` over windows of `window` seconds, for `seconds`."""
    device, size = a.device, a.shape[0]
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        runs, start, computing = 0, time.perf_counter(), clock()
        while time.perf_counter() - start < window or runs < 1:
            torch.mm(a, b)
            runs += 1
            if runs % 8 == 0:  # a GPU queues work: bound what the window's end leaves unfinished
                _sync(device)
        _sync(device)
        best = max(best, 2 * size**3 * runs / max(clock() - computing, 1e-9))
    return best


class IdleProfiler:
    """The matmul figure measured again once the node has been idle `every` seconds since it was last
    busy or measured (0: never): the figure at join may have been taken while other programs or nodes
    ran beside it (coordinator/calibration.py)."""

    def __init__(self, device: torch.device, every: float, progress: Progress):
        self.device, self.every, self.progress = device, every, progress
        self._since = time.monotonic()  # last busy, measured, or joined

    def measured(self, busy: bool) -> float | None:
        now = time.monotonic()
        if busy:
            self._since = now
        if busy or not self.every or now - self._since < self.every:
            return None
        self._since = now
        flops = matmul_flops(self.device)
        self.progress.log(f"measured {flops / 1e9:.1f} GFLOP/s again while idle")
        return flops


SAFETY_MARGIN = 0.8  # of the memory free now: the owner keeps using the machine
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """'6GiB', '512 MiB', '1.5G' (powers of 1000), '1000000' -> bytes; ValueError if not a size."""
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).upper())
    if not match or unit is None or float(match.group(1)) <= 0:
        raise ValueError(f"not a memory size: {text!r} (examples: 6GiB, 512MiB, 2G)")
    return int(float(match.group(1)) * unit)


def offered_memory(device: torch.device, max_memory: int | None = None) -> int:
    """What this node offers for training: a safety margin under what is free now, capped by the
    volunteer's `max_memory`."""
    offered = int(free_memory_bytes(device) * SAFETY_MARGIN)
    return offered if max_memory is None else min(offered, max_memory)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def coordinator_link(client: httpx.Client, probe_bytes: int = 1 << 20, probe_s: float = 0.25,
                     max_probe_bytes: int = 16 << 20) -> LinkFigures:
    """The link to the coordinator, from /healthz pings (their median) and probe downloads that grow
    while they are short (`growing_probe`: the longest repeated, their median and spread)."""
    _steady_get(client, "/healthz")  # opens the connection
    latency = statistics.median(_steady_get(client, "/healthz") for _ in range(PINGS))
    probe = lambda size: _steady_get(client, "/v1/probe", params={"bytes": size}, expect_busy=True)  # noqa: E731
    return LinkFigures(latency, *growing_probe(probe, latency, probe_bytes, max_probe_bytes, probe_s))


def _steady_get(client: httpx.Client, path: str, *, params: dict | None = None, expect_busy: bool = False,
                tries: int = 20) -> float:
    """Seconds one GET took. A dropped or reset connection (a coordinator busy with other joins
    resets some) and, where `expect_busy`, a busy answer (429: other nodes joining with the same
    token probe right now) are tried again after a random pause, which is not timed: a volunteer's
    join does not fail on one hiccup."""
    for attempt in range(tries):
        last = attempt == tries - 1
        start = time.perf_counter()
        try:
            response = client.get(path, params=params)
        except httpx.TransportError:
            if last:
                raise
            time.sleep(0.5 + random.random())
            continue
        took = time.perf_counter() - start
        if not (expect_busy and response.status_code == 429) or last:
            break
        time.sleep(0.5 + random.random())
    if response.status_code == 401:
        raise ApiError(f"the coordinator refused this node ({refusal_reason(response)}): it needs a valid "
                               "join token (--token or $RAVNEST_JOIN_TOKEN, from the coordinator's operator)", 401)
    response.raise_for_status()
    return took


def warm_up(device: torch.device) -> None:
    """Load what torch loads lazily on first use, before the node counts as idle: the first
    optimizer imports torch._dynamo and sympy (~70 MiB), the first forward and backward set up the
    kernels and their workspaces. A job's measured memory is then the job's own. A tiny gpt and a tiny
    cnn: the first convolution loads oneDNN's kernels (13 MiB on a CPU), which had made every digits
    CNN stage measure 14-17 MiB whatever its size."""
    from torch.func import functional_call  # noqa: F401  (the stage's forward)

    from ravnest.models import build_model
    from ravnest.pipeline.optim import build_optimizer
    from ravnest.spec import OptimizerRef

    tiny = [build_model("gpt", {"vocab_size": 8, "seq_len": 4, "d_model": 8, "n_layers": 1, "n_heads": 2}),
            build_model("cnn", {"channels": [2, 2], "image_size": 4, "num_classes": 8})]
    models = [spec.full_model(seed=0, device=device) for spec in tiny]
    optimizers = [build_optimizer(model.parameters(), OptimizerRef()) for model in models]
    targets = torch.zeros(2, 4, dtype=torch.int64, device=device)

    def step() -> None:
        for spec, model, optimizer in zip(tiny, models, optimizers):
            output = model(spec.example_input(2, device))
            spec.loss(output, targets[:, 0] if output.dim() == 2 else targets).backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    step()
    if device.type == "cuda":
        # a stage computes on a thread of its own, and a thread's first cuBLAS call allocates a workspace
        # (32 MiB on an H200, which stage peaks measured above their prediction); made here on a thread
        # that ends, it goes back to torch's handle pool for the stage's thread: part of the idle level
        worker = threading.Thread(target=step, name="warm-up")
        worker.start()
        worker.join()


def profile_node(client: httpx.Client, device: torch.device, max_memory: int | None = None,
                 datasets: Mapping[str, str] | None = None,
                 vocab_sizes: Mapping[str, int] | None = None) -> NodeProfile:
    """`datasets`: each offered name -> its file's fingerprint (ravnest/data/proof.py); `vocab_sizes`:
    each offered token file's vocabulary."""
    warm_up(device)
    link = coordinator_link(client)
    return NodeProfile(
        flops=matmul_flops(device), memory_bytes=offered_memory(device, max_memory), device=str(device),
        gpu_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        cores=torch.get_num_threads(), bandwidth_bytes_per_s=plausible_bandwidth(link.bandwidth),
        bandwidth_spread=min(link.spread, SPREAD["le"]), latency_s=min(link.latency, LATENCY["le"]),
        datasets=sorted(datasets or {}), fingerprints=dict(datasets or {}), vocab_sizes=dict(vocab_sizes or {}),
        idle_bytes=status_bytes("VmRSS") or 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
