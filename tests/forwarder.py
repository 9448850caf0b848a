"""A TCP forwarder for fault tests: what a home router or a NAT between two nodes does to a link."""
from __future__ import annotations

import socket
import struct
import threading
import time


class Forwarder:
    """A TCP forwarder from 127.0.0.1:`port` to `target` whose connections can be cut (each reset: the
    forwarder killed and started again, a NAT dropping its mappings) and held (nothing passes either way
    for a while, nothing is refused: a link that is down)."""

    def __init__(self, port: int, target: tuple[str, int]):
        self.target = target
        self._server = socket.create_server(("127.0.0.1", port))
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            for conn in self._open:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
                conn.close()
            self._open.clear()

    def hold(self, seconds: float) -> None:
        self._flowing.clear()
        time.sleep(seconds)  # the outage itself, what the test is about
        self._flowing.set()

    def close(self) -> None:
        self._server.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self._server.accept()
                self._flowing.wait()
                outbound = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._open += [inbound, outbound]
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                self._flowing.wait()
                sink.sendall(data)
        except OSError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
