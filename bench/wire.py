"""Tensor throughput between two processes: our OutboundStream/PeerServer against a raw gRPC byte stream.

Both runs move the same payload (fp32 tensors cut into chunks of the same size) from this process to
a receiver process started with `spawn`, each process on one torch thread. The raw stream is the
floor of what gRPC can do here: a generic handler with identity (de)serializers that receives bytes
and drops them. Ours also frames, validates and assembles real tensors on the receiving side. Both
run with the allocator setting our endpoints make (`keep_freed_buffers`), so only the framing differs.

    python -m bench.wire [--quick | --small] [--repeat N] [--no-docs]

`send(copy=False)` is measured too. The last line printed is
`wire throughput=<GB/s> raw_grpc=<GB/s>` (medians over the repeats, `send()` with its default copy).
With `--small`, the tensors are 5,000 of 13 kB (a share of a ring round among 8 members), where what
costs is per message, not per byte: ours sends each as one gRPC message (its frames bundled), as the
raw stream does, and the last line is `wire small_messages_per_s=<ours> raw_grpc=<raw>`.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from concurrent import futures

import grpc
import torch

from bench.common import command_line, write_section
from ravnest.wire import ChannelPool, Message, OutboundStream, PeerServer
from ravnest.wire.tensors import byte_view
from ravnest.wire.messages import DEFAULT_CHUNK_BYTES
from ravnest.wire.transport import GRPC_OPTIONS, keep_freed_buffers

RAW_METHOD = "/bench.Raw/Sink"
MIB = 1 << 20
# Sent first on the same connection and not timed: a fresh HTTP/2 connection starts with small flow-
# control windows that gRPC's bandwidth probe widens over the first tens of MiB, for both contenders.
WARMUP_TENSORS = 4
SMALL_COUNT, SMALL_BYTES = 5000, 13_056  # --small: a share of 26,112 fp32 values among 8 members


def _raw_sink(request_iterator, context) -> bytes:
    received = sum(len(chunk) for chunk in request_iterator)
    return received.to_bytes(8, "little")


def _serve(mode: str, addresses: mp.Queue, stop: mp.Event) -> None:
    """Receiver process: serve one kind of endpoint until told to stop."""
    torch.set_num_threads(1)
    if mode != "raw":
        server = PeerServer(lambda msg, peer: None)
        addresses.put(server.address)
        stop.wait()
        server.stop(0)
        return
    keep_freed_buffers()  # the same allocator setting as our endpoints, so only the framing differs
    raw = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    raw.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Raw", {"Sink": grpc.stream_unary_rpc_method_handler(_raw_sink)}),))
    port = raw.add_insecure_port("127.0.0.1:0")
    raw.start()
    addresses.put(f"127.0.0.1:{port}")
    stop.wait()
    raw.stop(0).wait()


def _send_wire(address: str, tensors: list[torch.Tensor], chunk_bytes: int, copy: bool = True) -> float:
    pool = ChannelPool()
    with OutboundStream(address, chunk_bytes=chunk_bytes, pool=pool) as warmup:  # same connection, untimed
        for t in tensors[:WARMUP_TENSORS]:
            warmup.send(Message("warmup", tensors={"x": t}))
    with OutboundStream(address, chunk_bytes=chunk_bytes, pool=pool) as stream:
        start = time.perf_counter()
        for i, t in enumerate(tensors):
            stream.send(Message("bench", i, {"x": t}), copy=copy)
        summary = stream.close()
    elapsed = time.perf_counter() - start
    pool.close()
    assert summary.messages == len(tensors), summary
    return elapsed


def _send_raw(address: str, tensors: list[torch.Tensor], chunk_bytes: int) -> float:
    keep_freed_buffers()
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    sink = channel.stream_unary(RAW_METHOD, request_serializer=None, response_deserializer=None)

    def chunks(tensors):
        for t in tensors:  # the bytes of each tensor, copied out chunk by chunk like any sender must
            view = byte_view(t)
            for start in range(0, len(view), chunk_bytes):
                yield bytes(view[start:start + chunk_bytes])

    sink(chunks(tensors[:WARMUP_TENSORS]))  # same connection, untimed
    start = time.perf_counter()
    received = int.from_bytes(sink(chunks(tensors)), "little")
    elapsed = time.perf_counter() - start
    channel.close()
    assert received == sum(t.numel() * t.element_size() for t in tensors), received
    return elapsed


def measure(mode: str, tensors: list[torch.Tensor], chunk_bytes: int) -> float:
    """GB/s for one transfer of `tensors` to a fresh receiver process."""
    ctx = mp.get_context("spawn")
    addresses, stop = ctx.Queue(), ctx.Event()
    receiver = ctx.Process(target=_serve, args=(mode, addresses, stop), daemon=True)
    receiver.start()
    try:
        address = addresses.get(timeout=60)
        if mode == "raw":
            elapsed = _send_raw(address, tensors, chunk_bytes)
        else:
            elapsed = _send_wire(address, tensors, chunk_bytes, copy=mode == "wire")
    finally:
        stop.set()
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()
    return sum(t.numel() * t.element_size() for t in tensors) / elapsed / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB in 4 MiB tensors instead of 1 GiB in 16 MiB")
    parser.add_argument("--small", action="store_true", help=f"{SMALL_COUNT} tensors of {SMALL_BYTES} bytes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / MIB)
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    total_mib, tensor_mib = (64, 4) if args.quick else (1024, 16)
    if args.small:
        total_mib, tensor_mib = SMALL_COUNT * SMALL_BYTES / MIB, SMALL_BYTES / MIB
    distinct = [torch.randn(int(tensor_mib * MIB) // 4) for _ in range(16)]  # reused: the payload need not be unique
    tensors = [distinct[i % len(distinct)] for i in range(round(total_mib / tensor_mib))]
    chunk_bytes = int(args.chunk_mib * MIB)
    modes = ("wire", "wire_nocopy", "raw")
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    for rep in range(args.repeat):
        for mode in modes if rep % 2 == 0 else modes[::-1]:  # alternate the order to spread drift
            results[mode].append(measure(mode, tensors, chunk_bytes))
        print(f"run {rep + 1}: " + ", ".join(f"{m} {results[m][-1]:.3f} GB/s" for m in modes), flush=True)
    median = {m: statistics.median(v) for m, v in results.items()}
    # Runs next to each other share the machine's load at that moment: their ratio is the steadier figure.
    ratios = {m: [w / r for w, r in zip(results[m], results["raw"])] for m in ("wire", "wire_nocopy")}
    figures = "\n".join(
        f"- {label}: median {median[m]:.3f} GB/s (min-max {min(results[m]):.3f}-{max(results[m]):.3f})"
        + (f"; ratio to raw gRPC in the same run: median {statistics.median(ratios[m]):.2f} "
           f"(min-max {min(ratios[m]):.2f}-{max(ratios[m]):.2f})" if m in ratios else "")
        for m, label in (("wire", "wire, `send()` (snapshots the tensors)"),
                         ("wire_nocopy", "wire, `send(copy=False)`"), ("raw", "raw gRPC byte stream")))
    if args.small:
        rate = {m: v * 1e9 / SMALL_BYTES for m, v in median.items()}
        summary = (f"{len(tensors):,} fp32 tensors of {SMALL_BYTES:,} bytes, one message each, sender and receiver in "
                   f"separate processes on loopback, 1 torch thread each, {args.repeat} runs on {os.cpu_count()} cores "
                   f"(load average {load:.1f} at the start), medians: ours {rate['wire']:,.0f} messages/s "
                   f"(`send(copy=False)`: {rate['wire_nocopy']:,.0f}), raw gRPC {rate['raw']:,.0f} messages/s; ratio "
                   f"in the same run {statistics.median(ratios['wire']):.2f}.")
        print(summary)
        if not args.no_docs:
            write_section("Wire (small messages)", f"Command: `{command_line('bench.wire', argv).strip()}`\n\n{summary}\n")
        print(f"wire small_messages_per_s={rate['wire']:.0f} raw_grpc={rate['raw']:.0f}")
        return
    summary = (f"{total_mib} MiB as {tensor_mib} MiB fp32 tensors in {args.chunk_mib:g} MiB chunks, sender and "
               f"receiver in separate processes on loopback after a {WARMUP_TENSORS * tensor_mib} MiB warm-up on the same "
               f"connection, 1 torch thread each, {args.repeat} runs on {os.cpu_count()} "
               f"cores (load average {load:.1f} at the start: other work shares the machine):\n\n{figures}")
    print(summary)
    if not args.no_docs:
        command = command_line("bench.wire", argv)
        write_section("Wire", f"Command: `{command.strip()}`\n\n{summary}\n")
    print(f"wire throughput={median['wire']:.3f} raw_grpc={median['raw']:.3f}")


if __name__ == "__main__":
    main()
