"""How soon a gRPC server refuses a message by its length prefix alone (server-side refusal time).

A client that sends a 15 MB prompt spends most of its wait building and writing those bytes; the
server can refuse as soon as the gRPC length prefix (the 5 bytes before the message) says the
message is too big. This probe measures only the server's part: over one plaintext HTTP/2
connection it sends the call's headers and a DATA frame holding the length prefix of a message of
`declared_bytes` and the first `sent_bytes` of it, then waits for the server to end the stream
(trailers with the status, or RST_STREAM). Nothing more is sent, so a server that waited for the
whole message would not answer before `timeout_s` (None is returned).

The HTTP/2 is hand-written (RFC 9113: the preface, SETTINGS, HEADERS with HPACK literals that need no
table, DATA), because nothing else here speaks it without also sending the message whole.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
_STREAM = 1
_MAX_FRAME = 16_384
"""The largest frame payload a peer must accept before its SETTINGS say more (RFC 9113 6.5.2)."""


@dataclass(frozen=True)
class Refusal:
    seconds: float
    """From the length prefix written to the server's end of the stream."""
    frame: str
    """How it ended the stream: "trailers" (a status) or "rst_stream"."""
    status: int | None
    """The grpc-status when the trailers carried it in plain text (HPACK literals without Huffman)."""


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


def refusal_time(address: str, method: str = "/cedserve.v1.Generation/Generate", declared_bytes: int = 15_000_000,
                 sent_bytes: int = 16_000, timeout_s: float = 10.0,
                 metadata: tuple[tuple[str, str], ...] = ()) -> Refusal | None:
    """Server-side refusal time of a message of `declared_bytes` (module docstring); None when the
    server did not end the stream within `timeout_s` (it waits for the message whole)."""
    if not 0 <= sent_bytes <= _MAX_FRAME - 5:
        raise ValueError(f"sent_bytes: the prefix and them must fit one {_MAX_FRAME}-byte DATA frame, got {sent_bytes}")
    host, port = address.rsplit(":", 1)
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", address),
        ("content-type", "application/grpc"), ("te", "trailers"), *metadata))
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0, b"") + _frame(_HEADERS, _END_HEADERS, _STREAM, headers))
        data = b"\x00" + struct.pack(">I", declared_bytes) + b"\x0a" * sent_bytes
        start = time.monotonic()
        sock.sendall(_frame(_DATA, 0, _STREAM, data))
        return _await_end(sock, start, timeout_s)


def _await_end(sock: socket.socket, start: float, timeout_s: float) -> Refusal | None:
    buffer = b""
    while time.monotonic() - start < timeout_s:
        sock.settimeout(max(0.01, timeout_s - (time.monotonic() - start)))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        if not chunk:
            return None  # closed without ending the stream
        buffer += chunk
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload, buffer = buffer[9:9 + length], buffer[9 + length:]
            if kind == _SETTINGS and not flags & _ACK:
                sock.sendall(_frame(_SETTINGS, _ACK, 0, b""))
            elif kind == _PING and not flags & _ACK:
                sock.sendall(_frame(_PING, _ACK, 0, payload))
            elif stream == _STREAM and kind == _RST_STREAM:
                return Refusal(time.monotonic() - start, "rst_stream", None)
            elif stream == _STREAM and kind == _HEADERS and flags & _END_STREAM:
                return Refusal(time.monotonic() - start, "trailers", _plain_status(payload))
            elif kind == _GOAWAY:
                return None
    return None


def _plain_status(block: bytes) -> int | None:
    name = b"\x0bgrpc-status"  # the name as a literal: its length, then its bytes
    at = block.find(name)
    if at < 0 or at + len(name) >= len(block) or block[at + len(name)] & 0x80:
        return None  # absent, or its value Huffman-coded
    size = block[at + len(name)]
    value = block[at + len(name) + 1:at + len(name) + 1 + size]
    return int(value) if value.isdigit() else None


def http_refusal_time(address: str, path: str = "/v1/completions", declared_bytes: int = 15_000_000,
                      sent_bytes: int = 16_000, timeout_s: float = 10.0) -> tuple[float, int] | None:
    """(seconds from the request's head written to the status line read, the status) of an HTTP/1.1
    POST declaring a `declared_bytes` body of which only `sent_bytes` are sent; None when no status
    line came within `timeout_s` (the server waits for the body)."""
    host, port = address.rsplit(":", 1)
    head = (f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared_bytes}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.monotonic()
        sock.sendall(head + b'{"prompt": "' + b"x" * sent_bytes)
        reply = b""
        while b"\r\n" not in reply:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                return None
            if not chunk:
                return None
            reply += chunk
        return time.monotonic() - start, int(reply.split(b" ", 2)[1])


def bare_server_refusal_time(max_message_bytes: int, declared_bytes: int = 15_000_000, samples: int = 5,
                             tarpit: bool = True) -> list[float]:
    """`refusal_time` against a gRPC server with no handler code at all (the `Generation` service's
    generated base class) and the same receive limit: the floor gRPC itself sets. `tarpit`: gRPC's
    default, which holds such a refusal back a random 100-1000 ms (`RouterConfig.grpc_tarpit`)."""
    from concurrent import futures

    import grpc

    from cedserve.proto import generation_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", max_message_bytes),
                                                                  ("grpc.http.tarpit", int(tarpit))])
    generation_pb2_grpc.add_GenerationServicer_to_server(generation_pb2_grpc.GenerationServicer(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = []
        for _ in range(samples):
            refusal = refusal_time(f"127.0.0.1:{port}", declared_bytes=declared_bytes)
            if refusal is not None:
                out.append(round(refusal.seconds, 4))
        return out
    finally:
        server.stop(0)


def sent_refusal_time(address: str, message: bytes, method: str = "/cedserve.v1.Generation/Generate",
                      timeout_s: float = 30.0) -> tuple[float, str]:
    """(seconds, status name) of a real gRPC call that sends `message`, already serialized, over a
    connected channel: what a client waits from its first byte written to the refusal, without
    building or serializing the message (`client_build_and_serialize_s` is that part)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return send_serialized(channel, message, method, timeout_s)


def send_serialized(channel: Any, message: bytes, method: str = "/cedserve.v1.Generation/Generate",
                    timeout_s: float = 30.0) -> tuple[float, str]:
    """`sent_refusal_time`'s call on a channel the caller connected (a `grpc.Channel`)."""
    import grpc

    call = channel.unary_stream(method)  # no serializers: the bytes go as they are
    start = time.monotonic()
    try:
        for _ in call(message, timeout=timeout_s):
            pass
    except grpc.RpcError as exc:
        return time.monotonic() - start, exc.code().name
    return time.monotonic() - start, "OK"
