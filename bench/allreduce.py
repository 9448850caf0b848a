"""Ring all-reduce: ours against torch.distributed gloo on loopback, and against the link bound on
bandwidth-shaped links.

    python -m bench.allreduce [--size-mib 64] [--quick] [--rounds 3] [--no-docs]
    python -m bench.allreduce --shaped [--size-mib 32] [--quick]     # root, ip and tc

Loopback: for world sizes 2 and 4, members are separate processes with one torch thread each; ours,
gloo, and our `backend: "torch"` (ravnest/averaging/torch_group.py: gloo behind our rendezvous, what
a job on a trusted cluster runs) reduce the same fp32 tensor. Bus bandwidth = 2(n-1)/n * S / t, t = the slowest member's
time, median over rounds. Last line: `allreduce ratio_vs_gloo=<ours/gloo, worse world size>`.

Shaped: 4 members in network namespaces (deploy/testbed/netns.sh), member 0 at 50 Mbit/s and the
others at 200 Mbit/s, tbf-shaped both ways; the ring with equal and with balanced shares, and the robust
round (centered_clip), whose equal shares have the equal ring's bound. Link r -> r+1 runs at
min(rate r, rate r+1) and carries (2 - f[r+1] - f[r+2]) * S for share fractions f (see
ravnest/averaging/shares.py), so a split's bound is max over links of load / rate; for equal links and
shares that is the classic 2(n-1)/n * S / B.
We use `balanced_shares`, which for this testbed gives the slow member the whole vector to own: its
two links then carry S each, so the bound is S / 50 Mbit/s, which is also the cut bound for any
all-reduce (S must leave and enter the slow member). Last line: `allreduce bound_ratio=<t / bound>`.

Each member process is `python -m bench.allreduce --member ...`, steered over stdin/stdout with one
JSON object per line (its address, then "go" -> its seconds for one round).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MIB = 1 << 20
TOKEN = "bench-allreduce"
ROOT = Path(__file__).resolve().parent.parent
TESTBED = ROOT / "deploy" / "testbed" / "netns.sh"
SHAPED_RATES_MBIT = [50, 200, 200, 200]
SHAPED_CHUNK_BYTES = 128 * 1024  # small chunks: the pipeline fills in ~2 chunk times of the slow link
# members talk JSON on stdout; keep gRPC's shutdown chatter (peers hanging up) off stderr
_MEMBER_ENV = {**os.environ, "GRPC_VERBOSITY": "ERROR"}


# --- member processes -------------------------------------------------------------------------------

def member_input(rank: int, numel: int) -> torch.Tensor:
    """Member `rank`'s vector; any process can rebuild every member's to check the mean."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _ring_member(args: argparse.Namespace) -> None:
    from ravnest.averaging import RingMember, reference_mean
    from ravnest.wire import PeerServer, Router
    router = Router(wait_for_route=60.0)  # (a peer's first round can come before this member built its ring)
    server = PeerServer(router, args.host, token=TOKEN)
    _emit({"address": server.address})
    addresses = json.loads(sys.stdin.readline())["addresses"]
    weights = json.loads(args.weights) if args.weights else None
    if args.backend == "torch":  # our gloo backend: rendezvous over the peer wire, then gloo
        from ravnest.averaging.torch_group import TorchMember
        member = TorchMember(args.member, addresses, router, TOKEN, step_timeout=120.0)
    else:
        from ravnest.averaging.signatures import public_key
        member = RingMember(args.member, addresses, router, TOKEN, weights=weights, codec=args.codec,
                            chunk_bytes=args.chunk_bytes, step_timeout=120.0, lanes=args.lanes,
                            keys=[public_key(TOKEN)] * len(addresses))
    x = member_input(args.member, args.numel)
    result = torch.empty_like(x)
    try:  # (a member that raises must still stop its server, or its process never exits)
        for round, _ in enumerate(sys.stdin):
            result.copy_(x)  # in place, like gloo's all_reduce, into a buffer reused every round
            start, cpu = time.perf_counter(), time.process_time()
            if args.robust:
                from ravnest.averaging.robust_round import robust_allreduce
                robust_allreduce(member, result, round, args.robust, out=result)
            else:
                member.allreduce(result, round, out=result)
            reply = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}
            if args.check and round == 0:
                expected = reference_mean([member_input(r, args.numel) for r in range(args.world)])
                reply["max_error"] = float((result - expected).abs().max()) if args.numel else 0.0
            _emit(reply)
    finally:
        member.close()
        server.stop(0)


def _gloo_member(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.member,
                            world_size=args.world)
    _emit({"ready": True})
    x = member_input(args.member, args.numel)
    y = torch.empty_like(x)
    for _ in sys.stdin:
        y.copy_(x)
        start, cpu = time.perf_counter(), time.process_time()
        dist.all_reduce(y)
        _emit({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu})
    dist.destroy_process_group()


# --- the parent: launching and timing members -------------------------------------------------------

class Members:
    """Member processes steered over pipes; `round()` runs one all-reduce on all of them."""

    def __init__(self, commands: list[list[str]]):
        self.procs: list[subprocess.Popen] = []
        try:
            for command in commands:
                self.procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   text=True, bufsize=1, cwd=ROOT, env=_MEMBER_ENV))
        except BaseException:
            self.close()
            raise

    def read(self) -> list[dict]:
        replies = []
        for proc in self.procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"member process {proc.args[-8:]} exited with {proc.wait()}")
            replies.append(json.loads(line))
        return replies

    def write(self, obj: dict) -> None:
        for proc in self.procs:
            proc.stdin.write(json.dumps(obj) + "\n")
            proc.stdin.flush()

    def round(self) -> list[dict]:
        self.write({"go": True})
        return self.read()

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _member_command(rank: int, world: int, numel: int, extra: list[str], prefix: list[str] = ()) -> list[str]:
    return [*prefix, sys.executable, "-m", "bench.allreduce", "--member", str(rank), "--world", str(world),
            "--numel", str(numel), *extra]


def run_ring(world: int, numel: int, *, rounds: int, warmup: int = 1, hosts: list[str] | None = None,
             netns: list[str] | None = None, chunk_bytes: int = 4 * MIB, weights: list[float] | None = None,
             codec: str = "", lanes: int = 1, check: bool = False, backend: str = "grpc", robust: str = "") -> dict:
    """Our ring (or with backend "torch", our gloo backend; or with `robust`, our robust round of that
    rule) over `world` member processes: per-round times (slowest member) and the max error of the
    first round's result against the reference mean (with `check`)."""
    hosts = hosts or ["127.0.0.1"] * world
    extra = ["--chunk-bytes", str(chunk_bytes), "--codec", codec, "--lanes", str(lanes), "--backend", backend,
             "--robust", robust]
    extra += ["--weights", json.dumps(weights)] if weights else []
    extra += ["--check"] if check else []
    commands = [_member_command(r, world, numel, [*extra, "--host", hosts[r]],
                                ["ip", "netns", "exec", netns[r]] if netns else [])
                for r in range(world)]
    members = Members(commands)
    try:
        members.write({"addresses": [reply["address"] for reply in members.read()]})
        times, cpu, errors = [], [], []
        for i in range(warmup + rounds):
            replies = members.round()
            errors += [r["max_error"] for r in replies if "max_error" in r]
            if i >= warmup:
                times.append(max(r["seconds"] for r in replies))
                cpu.append(sum(r["cpu"] for r in replies))
    finally:
        members.close()
    return {"times": times, "cpu": cpu, "max_error": max(errors) if errors else None}


def run_gloo(world: int, numel: int, *, rounds: int, warmup: int = 1) -> dict:
    """torch.distributed gloo all_reduce over loopback: per-round times (slowest member) and CPU
    seconds (all members)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    members = Members([_member_command(r, world, numel, ["--gloo", "--port", str(port)]) for r in range(world)])
    try:
        members.read()
        replies = [members.round() for _ in range(warmup + rounds)][warmup:]
    finally:
        members.close()
    return {"times": [max(r["seconds"] for r in rs) for rs in replies],
            "cpu": [sum(r["cpu"] for r in rs) for rs in replies]}


def bus_bandwidth(world: int, nbytes: int, seconds: float) -> float:
    return 2 * (world - 1) / world * nbytes / seconds


# --- the two benchmarks ------------------------------------------------------------------------------

def loopback(args: argparse.Namespace) -> str:
    nbytes = int(args.size_mib * MIB) // 4 * 4
    lines, ratios = [], []
    for world in (2, 4):
        ours = run_ring(world, nbytes // 4, rounds=args.rounds, lanes=args.lanes, check=True)
        gloo = run_gloo(world, nbytes // 4, rounds=args.rounds)
        backend = run_ring(world, nbytes // 4, rounds=args.rounds, check=True, backend="torch")
        t_ours, t_gloo = statistics.median(ours["times"]), statistics.median(gloo["times"])
        t_backend = statistics.median(backend["times"])
        cpu_ours, cpu_gloo = statistics.median(ours["cpu"]), statistics.median(gloo["cpu"])
        ratio = t_gloo / t_ours
        ratios.append(ratio)
        line = (f"n={world}: ours {t_ours * 1e3:.0f} ms, bus {bus_bandwidth(world, nbytes, t_ours) / 1e9:.3f} GB/s, "
                f"CPU {cpu_ours:.2f} s (max error vs reference {ours['max_error']:.1e}); gloo {t_gloo * 1e3:.0f} ms, "
                f"bus {bus_bandwidth(world, nbytes, t_gloo) / 1e9:.3f} GB/s, CPU {cpu_gloo:.2f} s; ours/gloo {ratio:.2f}; "
                f"backend torch (gloo behind our rendezvous) {t_backend * 1e3:.0f} ms, bus "
                f"{bus_bandwidth(world, nbytes, t_backend) / 1e9:.3f} GB/s (max error {backend['max_error']:.1e})")
        print(line, flush=True)
        lines.append(line)
    summary = (f"{args.size_mib:g} MiB fp32 on 127.0.0.1, one process per member, 1 torch thread each, "
               f"median of {args.rounds} rounds after a warm-up, 4 MiB chunks, {args.lanes} stream(s) per "
               f"neighbour. CPU is the CPU seconds of all members together per round. On two shared cores "
               f"CPU per byte sets the pace, and gRPC Python copies every byte in user space where gloo "
               f"reads and writes sockets straight from tensor memory: the sender copies the chunk into its "
               f"frame and gRPC copies the frame into a slice; the receiver gets the message as 64 KiB "
               f"slices, each copied into a bytes object, then joined into one (ring chunks are then used in "
               f"place, without a further copy), and checks it for NaN with one sum. That is about four "
               f"user-space copies per byte against none, hence two to three times gloo's CPU per round; the "
               f"Wire section shows the transport's one-way ceiling.\n\n"
               + "\n".join(f"- {line}" for line in lines))
    _write_docs(args, "All-reduce", summary)
    return f"allreduce ratio_vs_gloo={min(ratios):.3f}"


def _shaping_available() -> str | None:
    """Why the shaped benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {' and '.join(missing)}" if missing else None


def shaped(args: argparse.Namespace) -> str | None:
    from ravnest.averaging import balanced_shares, ring_time_bound
    reason = _shaping_available()
    if reason:
        print(f"allreduce shaped benchmark skipped: {reason}")
        return None
    rates = SHAPED_RATES_MBIT
    n = len(rates)
    nbytes = int(args.size_mib * MIB) // 4 * 4
    link_rates = [min(rates[r], rates[(r + 1) % n]) * 1e6 / 8 for r in range(n)]  # bytes/s of r -> r+1
    # the robust round (averaging.robust) moves the ring's bytes with equal shares: the same bound as "equal"
    splits = {"equal": ([1.0] * n, ""), "balanced": (balanced_shares(link_rates), ""),
              "robust (centered_clip), equal": ([1.0] * n, "centered_clip")}
    lines, ratio = [], 0.0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that `finally` below still removes the testbed
    try:
        subprocess.run(["bash", str(TESTBED), "up", *map(str, rates)], check=True)
        for name, (shares, robust) in splits.items():
            result = run_ring(n, nbytes // 4, rounds=args.rounds, chunk_bytes=SHAPED_CHUNK_BYTES, weights=shares,
                              hosts=[f"10.77.0.{r + 1}" for r in range(n)], netns=[f"rvn-m{r}" for r in range(n)],
                              check=not robust, robust=robust)
            t = statistics.median(result["times"])
            bound = ring_time_bound(nbytes, shares, link_rates)
            fractions = [round(f / sum(shares), 3) for f in shares]
            checked = f" (max error vs reference {result['max_error']:.1e})" if not robust else ""
            line = f"{name} shares {fractions}: {t:.2f} s, bound {bound:.2f} s, ratio {t / bound:.2f}{checked}"
            print(line, flush=True)
            lines.append(line)
            ratio = t / bound if name == "balanced" else ratio
    except subprocess.CalledProcessError as e:
        print(f"allreduce shaped benchmark skipped: could not build the testbed ({e})")
        return None
    finally:
        subprocess.run(["bash", str(TESTBED), "down"], check=False)
    summary = (
        f"{args.size_mib:g} MiB fp32, 4 members in network namespaces (deploy/testbed/netns.sh), member link "
        f"rates {rates} Mbit/s (tbf, both directions), {SHAPED_CHUNK_BYTES // 1024} KiB chunks, median of "
        f"{args.rounds} rounds after a warm-up.\n\n"
        "Bound of a split: at ring step L member r sends share (r - L) mod n to r+1, for 2n-2 steps, so link "
        "r -> r+1 carries every share twice except shares r+1 (owned by r) and r+2: (2 - f[r+1] - f[r+2]) * S "
        "bytes for share fractions f. It runs at min(rate r, rate r+1), so the split's bound is the largest "
        "load / rate over the links (2(n-1)/n * S / B for equal links and shares). The balanced split "
        "(`ravnest.averaging.balanced_shares`) lets the slow member own the whole vector: its two links then "
        "carry S each and the bound is S / 50 Mbit/s, which is also the cut bound of any all-reduce here "
        "(S must leave and enter the slow member). The measured time includes TCP/IP headers (~4.5% at "
        "MTU 1500) and the pipeline's fill (about two chunk times of the slow link). The robust round "
        "(`averaging.robust`, ravnest/averaging/robust_round.py) sends each member's share k straight to member "
        "k and the means back, with equal shares: each member's link carries 2(n-1)/n * S each way, the equal "
        "ring's bound.\n\n"
        + "\n".join(f"- {line}" for line in lines))
    _write_docs(args, "All-reduce (shaped links)", summary)
    return f"allreduce bound_ratio={ratio:.3f}"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _write_docs(args: argparse.Namespace, title: str, summary: str) -> None:
    if args.no_docs:
        return
    from bench.common import write_section
    command = "python -m bench.allreduce " + " ".join(args.argv)
    write_section(title, f"`{command.strip()}`\n\n{summary}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=None, help="vector size (64 loopback, 32 shaped)")
    parser.add_argument("--quick", action="store_true", help="16 MiB and at most 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=1, help="parallel streams per neighbour (ours)")
    parser.add_argument("--shaped", action="store_true", help="namespaces + tbf testbed (root, ip, tc)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    member = parser.add_argument_group("member process (internal)")
    member.add_argument("--member", type=int, default=None, help=argparse.SUPPRESS)
    for flag, kind, default in [("--world", int, 0), ("--numel", int, 0), ("--host", str, "127.0.0.1"),
                                ("--port", int, 0), ("--chunk-bytes", int, 4 * MIB), ("--codec", str, ""),
                                ("--weights", str, ""), ("--backend", str, "grpc"), ("--robust", str, "")]:
        member.add_argument(flag, type=kind, default=default, help=argparse.SUPPRESS)
    member.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    member.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    if args.member is not None:
        (_gloo_member if args.gloo else _ring_member)(args)
        return
    if args.quick:
        args.rounds = min(args.rounds, 2)
    if args.size_mib is None:
        args.size_mib = 16.0 if args.quick else 32.0 if args.shaped else 64.0
    last = shaped(args) if args.shaped else loopback(args)
    if last:
        print(last)


if __name__ == "__main__":
    main()
