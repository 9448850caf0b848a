"""What a node measures about itself before joining: compute, memory, device, link to the coordinator."""
from __future__ import annotations

import os
import time

import httpx
import torch

from ravnest.spec import NodeProfile


def pick_device(choice: str = "auto") -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(choice)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but CUDA is not available on this machine")
    return device


def matmul_flops(device: torch.device, size: int = 512, seconds: float = 0.3) -> float:
    """Sustained fp32 matmul FLOP/s: the figure the planner divides block FLOPs by."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up (kernel selection, lazy init)
    _sync(device)
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs < 3:
        torch.mm(a, b)
        runs += 1
        if runs % 8 == 0:
            _sync(device)
    _sync(device)
    elapsed = time.perf_counter() - start
    return 2 * size**3 * runs / elapsed


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


def coordinator_link(client: httpx.Client, probe_bytes: int = 1 << 20) -> tuple[float, float]:
    """(round-trip seconds, bytes/s) to the coordinator, from /healthz pings and one probe download."""
    client.get("/healthz")  # opens the connection
    latency = min(_timed(lambda: client.get("/healthz")) for _ in range(3))
    elapsed = _timed(lambda: client.get("/v1/probe", params={"bytes": probe_bytes}).raise_for_status())
    return latency, probe_bytes / max(elapsed - latency, 1e-6)


def profile_node(client: httpx.Client, device: torch.device) -> NodeProfile:
    latency, bandwidth = coordinator_link(client)
    return NodeProfile(
        flops=matmul_flops(device), memory_bytes=free_memory_bytes(device), device=str(device),
        gpu_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        cores=torch.get_num_threads(), bandwidth_bytes_per_s=bandwidth, latency_s=latency)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
