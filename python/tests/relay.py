"""A TCP relay for tests of what crosses the wire: it forwards every connection to a target port,
records every byte each way, and may flip one byte of what clients send."""

import socket
import threading


class Relay:
    """Listens on a loopback port (`port`) and forwards each connection to `target_port`. `up` holds
    what clients sent, `down` what the server answered, over all connections in order; with
    `flip_at`, the byte at that offset of `up` is flipped on its way."""

    def __init__(self, target_port: int, flip_at=None):
        self.target = target_port
        self.flip_at = flip_at
        self.up, self.down = bytearray(), bytearray()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def seen(self) -> bytes:
        return bytes(self.up) + bytes(self.down)

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, self.up, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down, False),
                             daemon=True).start()

    def _pump(self, src, dst, record, flip):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                data = bytearray(data)
                if flip and self.flip_at is not None:
                    at = self.flip_at - len(record)
                    if 0 <= at < len(data):
                        data[at] ^= 0x01
                record += data
                dst.sendall(bytes(data))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
