"""Client side of `cedserve drain`, the pods' preStop hook: grpc and the Lifecycle stubs only.

Kept apart from `cedserve.serving` (the server side, `serving/drain.py`'s `LifecycleServicer`), whose
worker modules pull in torch through the model and transfer layers: the hook runs inside the pod's
termination grace period, so it must start in a fraction of a second. A test (tests/unit/test_serving.py) keeps torch out of this path.
"""

from __future__ import annotations

import logging

import grpc

from cedserve.proto import lifecycle_pb2, lifecycle_pb2_grpc

log = logging.getLogger(__name__)


def request_drain(address: str, timeout_s: float) -> lifecycle_pb2.DrainReply | None:
    """Ask the process at `address` to drain and wait up to `timeout_s` for it (plaintext: with TLS
    on, aim it at the health listener, which serves Drain too). None when it could not be reached."""
    with grpc.insecure_channel(address) as channel:
        stub = lifecycle_pb2_grpc.LifecycleStub(channel)  # type: ignore[no-untyped-call]
        try:
            reply: lifecycle_pb2.DrainReply = stub.Drain(lifecycle_pb2.DrainRequest(timeout_s=timeout_s),
                                                         timeout=timeout_s + 1.0)
        except grpc.RpcError as exc:
            log.warning("drain of %s: %s", address, exc)
            return None
        return reply
