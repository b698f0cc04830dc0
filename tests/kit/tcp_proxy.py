"""A TCP forwarder on 127.0.0.1 that tests cut and restore: a database outage on demand."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Forwards TCP connections from ``bind:port`` to ``target``; :meth:`cut` drops them all.

    While cut, open connections are closed and new ones are accepted and closed at once: to a
    client the database is unreachable, as when a server restarts or a network fails.
    :meth:`blackhole` is a silent network instead: nothing is forwarded any more and nothing is
    closed (what is sent is read and dropped, new connections are accepted and never answered),
    as when packets stop on the way with no reset; only the client's timeouts end its waits.
    """

    def __init__(self, target: tuple[str, int], bind: str = "127.0.0.1") -> None:
        self.target = target
        self.listener = socket.create_server((bind, 0))
        self.port = self.listener.getsockname()[1]
        self.cut_off = threading.Event()
        self.silent = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.num_refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                self.num_refused += 1
                client.close()
                continue
            if self.silent.is_set():  # accepted, never answered
                with self.lock:
                    self.sockets.append(client)
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.silent.is_set():  # else dropped on the way
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.cut_off.set()
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def blackhole(self) -> None:
        """Stop forwarding without closing anything (see the class doc)."""
        self.silent.set()

    def restore(self) -> None:
        self.cut_off.clear()
        self.silent.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()
