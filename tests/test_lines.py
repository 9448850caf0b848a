"""The testbed's delay lines (deploy/testbed/linedelay.py, through netns.sh): a round trip, jitter and
loss that TCP itself sees, packet by packet, on top of tbf's bandwidth. Real sockets in network
namespaces; each measurement is bounded in bytes or seconds."""
from __future__ import annotations

import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ravnest.pipeline.local import enter_network_namespace
from scripts.testbed import HUB, HUB_ADDRESS, Line, line_cpu_seconds, member, namespaces, set_line, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
PORT = 9310


def address(i: int) -> str:
    return f"10.77.0.{i + 1}"


def in_namespace(name: str, fn, *args):
    """`fn(*args)` on a thread inside network namespace `name`."""
    with ThreadPoolExecutor(1, initializer=enter_network_namespace, initargs=(name,)) as thread:
        return thread.submit(fn, *args).result()


def listening(namespace: str, host: str, serve) -> socket.socket:
    """A listening socket in `namespace` whose connections `serve(conn)` handles on threads, until closed."""
    server = in_namespace(namespace, socket.create_server, (host, PORT))

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def connect_round_trips(host: str, count: int = 12) -> list[float]:
    """Milliseconds each TCP handshake took (SYN out, SYN-ACK back: one round trip), as ping would
    see it: the first, which also resolves the neighbour's address, is left out, and each waits until
    the last one's closing frames have gone through (a line keeps frames in order)."""
    times = []
    for _ in range(count + 1):
        start = time.perf_counter()
        socket.create_connection((host, PORT), timeout=10).close()
        times.append((time.perf_counter() - start) * 1000)
        time.sleep(times[-1] / 1000)
    return times[1:]


def drain(conn: socket.socket) -> None:
    with conn:
        while conn.recv(1 << 20):
            pass


def stream_mbit(host: str, seconds: float, port: int = PORT) -> float:
    """Mbit/s one TCP stream sends over the second half of `seconds` (past slow start)."""
    chunk, marks = b"\0" * (1 << 16), []
    with socket.create_connection((host, port), timeout=30) as conn:
        start = time.perf_counter()
        sent = 0
        while (now := time.perf_counter()) - start < seconds:
            conn.sendall(chunk)
            sent += len(chunk)
            marks.append((now - start, sent))
    # what left the sender's buffer over the second half: a send buffer's worth of error, at most 4 MiB
    half = next(m for m in marks if m[0] >= seconds / 2)
    return (marks[-1][1] - half[1]) * 8 / (marks[-1][0] - half[0]) / 1e6


def test_a_line_adds_its_round_trip_and_jitter_and_tcp_sees_it():
    lines = [Line(100, 10), None, Line(50)]
    with namespaces([member(100, lines[0]), member(100), member(25, lines[2])]):
        servers = [listening(HUB, HUB_ADDRESS, lambda c: c.close()),
                   listening("rvn-m1", address(1), drain)]
        try:
            to_hub = {i: in_namespace(f"rvn-m{i}", connect_round_trips, HUB_ADDRESS) for i in range(3)}
            print({i: f"median {statistics.median(t):.1f} ms, {min(t):.1f}-{max(t):.1f}" for i, t in to_hub.items()})
            assert 90 <= statistics.median(to_hub[0]) <= 110 and 45 <= statistics.median(to_hub[2]) <= 55
            assert statistics.median(to_hub[1]) < 5  # no line: the bridge alone
            assert all(88 <= t <= 113 for t in to_hub[0]) and max(to_hub[0]) - min(to_hub[0]) > 2  # +- 10 ms
            assert all(48 <= t <= 60 for t in to_hub[2])  # no jitter asked: only scheduling's (a busy host)

            # member 0 to member 1: 100 ms; one stream fills 100 Mbit/s (the kernel's windows allow 4 MiB
            # in flight, more than the 1.25 MB a 100 ms round trip at 100 Mbit/s needs), and no more
            cpu_before = line_cpu_seconds(0)
            full = in_namespace("rvn-m0", stream_mbit, address(1), 6.0)
            cpu = (line_cpu_seconds(0) - cpu_before) / 6.0
            print(f"one stream over 100 ms at 100 Mbit/s: {full:.1f} Mbit/s; the line's emulator used "
                  f"{cpu:.2f} CPU s per s")
            assert 80 <= full <= 102
            assert cpu < 0.6
        finally:
            for server in servers:
                server.close()

        # a clamped window allows so many bytes per round trip: twice the round trip, half the throughput
        clamp = 256 << 10
        server = in_namespace("rvn-m1", socket.socket)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, clamp)  # accepted sockets inherit it
        in_namespace("rvn-m1", server.bind, (address(1), PORT + 1))
        server.listen()
        threading.Thread(target=lambda: [drain(server.accept()[0]) for _ in range(2)], daemon=True).start()
        try:
            clamped = in_namespace("rvn-m0", stream_mbit, address(1), 6.0, PORT + 1)
            set_line(0, Line(200))
            longer = in_namespace("rvn-m0", stream_mbit, address(1), 6.0, PORT + 1)
        finally:
            server.close()
        print(f"with a {clamp >> 10} KiB window clamp: {clamped:.1f} Mbit/s at 100 ms, {longer:.1f} at 200 ms")
        assert clamped < 0.6 * full and 0.4 <= longer / clamped <= 0.6


def test_a_running_line_changes_and_loses_what_it_is_told_to():
    with namespaces([member(100, Line(20)), member(100)]):
        server = listening(HUB, HUB_ADDRESS, lambda c: c.close())
        try:
            set_line(0, Line(200, 0))
            slow = statistics.median(in_namespace("rvn-m0", connect_round_trips, HUB_ADDRESS, 5))
            assert 190 <= slow <= 215, slow
            set_line(0, Line(0, 0, 0.2))  # 20% each way: a handshake survives both ways 64% of the time
        finally:
            server.close()

        # loss, counted on datagrams one way: 2,000 through a line that drops 20% of frames
        receiver = in_namespace(HUB, socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        in_namespace(HUB, receiver.bind, (HUB_ADDRESS, PORT))
        receiver.settimeout(1.0)
        got = 0

        def count():  # as they come: a socket's buffer holds only a few hundred
            nonlocal got
            try:
                while receiver.recv(200):
                    got += 1
            except TimeoutError:
                pass

        counting = threading.Thread(target=count)
        counting.start()
        sender = in_namespace("rvn-m0", socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        with receiver, sender:
            for _ in range(2000):
                sender.sendto(b"x" * 100, (HUB_ADDRESS, PORT))
                time.sleep(0.0002)
            counting.join()
        print(f"{got} of 2000 datagrams through a line losing 20%")
        assert 1500 <= got <= 1700  # 1,600 expected: a binomial's sd is 18


PROBE_SERVER = ("import sys, time; from ravnest.wire.transport.peer_server import PeerServer; "
                "server = PeerServer(lambda *_: None, host=sys.argv[1], port=int(sys.argv[2]), token='t'); "
                "print('up', flush=True); time.sleep(120)")
PROBE = ("import sys; from ravnest.wire import measure_link; "
         "print(*measure_link(sys.argv[1], token='t', timeout=20.0))")


def test_a_peer_200_ms_away_connects_and_its_probe_reads_the_round_trip():
    """A node's own link probe (gRPC Pings) across a line: it connects at all (gRPC gave a connection
    attempt 100 ms once, and no peer 100 ms away ever connected) and reads the round trip asked."""
    import subprocess
    import sys
    with namespaces([member(100, Line(100)), member(100)]):
        server = subprocess.Popen(["ip", "netns", "exec", "rvn-m1", sys.executable, "-c", PROBE_SERVER, address(1),
                                   str(PORT)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            for rtt in (100, 200):
                set_line(0, Line(rtt))
                probe = subprocess.run(["ip", "netns", "exec", "rvn-m0", sys.executable, "-c", PROBE,
                                        f"{address(1)}:{PORT}"], capture_output=True, text=True, timeout=60)
                assert probe.returncode == 0, probe.stderr[-2000:]
                latency, bandwidth, spread = map(float, probe.stdout.split())
                print(f"probe at {rtt} ms: round trip {latency * 1000:.1f} ms, {bandwidth * 8 / 1e6:.0f} Mbit/s "
                      f"(repeats {spread:.2f}x apart)")
                assert 0.95 * rtt <= latency * 1000 <= 1.1 * rtt
        finally:
            server.kill()
            server.wait()
