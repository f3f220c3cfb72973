"""TLS and mTLS for every gRPC listener and channel: one typed config, shared by the public port,
the workers' internal service and the KV-transfer control plane.

A process has one identity per plane: `cert`/`key` are served on its listeners and presented as its
client certificate on the calls it makes (mTLS), and `ca` verifies the other side (the servers it
calls, and client certificates when `require_client_cert`). The serve config holds two tables of
this shape: `[tls]` (the router's public port) and `[internal_tls]` (router <-> workers, prefill <->
decode control plane); flags override single fields (docs/security.md).

    tls = TLSConfig(cert="server.pem", key="server.key", ca="ca.pem", require_client_cert=True)
    port = add_port(server, "0.0.0.0:50061", tls)          # secure when tls.enabled
    channel = open_channel("10.0.0.7:50061", tls)          # grpc.Channel
    channel = open_aio_channel("10.0.0.7:50061", tls)      # grpc.aio.Channel

Files are read when credentials are built; an unreadable one raises `ValueError` naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import grpc
import msgspec


class _Listener(Protocol):
    """`grpc.Server` and `grpc.aio.Server` alike."""

    def add_insecure_port(self, address: str) -> int: ...

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int: ...


class TLSConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Certificates of one plane. All fields unset (the default): plaintext."""

    cert: str | None = None
    """PEM certificate chain of this process: served on its listeners, presented on its calls (mTLS)."""
    key: str | None = None
    """PEM private key of `cert`."""
    ca: str | None = None
    """PEM CA bundle that verifies peers: the servers this process calls (None: the system roots) and,
    on listeners, client certificates."""
    require_client_cert: bool = False
    """Listeners refuse clients without a certificate signed by `ca` (mTLS)."""
    server_name: str | None = None
    """Name expected in the servers' certificates instead of the dialed host (pods are dialed by IP:
    issue one certificate with this DNS name for the whole plane)."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS fields `cert` and `key` must be given together")
        if self.require_client_cert and (self.ca is None or self.cert is None):
            raise ValueError("TLS field `require_client_cert` needs `ca` (to verify clients) and `cert`/`key`")

    @property
    def enabled(self) -> bool:
        """Listeners serve TLS (they need `cert`) and channels dial TLS."""
        return self.cert is not None or self.ca is not None

    def override(self, **fields: object) -> TLSConfig:
        """A copy with the fields given non-None (command-line flags over the config file)."""
        given = {k: v for k, v in fields.items() if v is not None}
        return msgspec.structs.replace(self, **given) if given else self

    def server_credentials(self, where: str = "tls") -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError(f"config field `{where}.cert`: a TLS listener needs `cert` and `key`")
        pair = (_read(self.key, f"{where}.key"), _read(self.cert, f"{where}.cert"))
        ca = _read(self.ca, f"{where}.ca") if self.ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=self.require_client_cert)

    def channel_credentials(self, where: str = "tls") -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, f"{where}.ca") if self.ca else None,
            private_key=_read(self.key, f"{where}.key") if self.key else None,
            certificate_chain=_read(self.cert, f"{where}.cert") if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str | None, field: str) -> bytes:
    assert path is not None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"config field `{field}`: cannot read {path}: {exc.strerror}") from None


PLAINTEXT = TLSConfig()


def add_port(server: _Listener, address: str, tls: TLSConfig, where: str = "tls") -> int:
    """Bind `address` (TLS when `tls.enabled`); the bound port, 0 when binding failed."""
    if tls.enabled:
        return server.add_secure_port(address, tls.server_credentials(where))
    return server.add_insecure_port(address)


def open_channel(address: str, tls: TLSConfig, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    opts = [*(options or []), *tls.channel_options()]
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(address, options=opts)


def open_aio_channel(address: str, tls: TLSConfig,
                     options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    opts = [*(options or []), *tls.channel_options()]
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)

