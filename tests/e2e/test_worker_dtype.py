"""`cedserve worker --dtype bfloat16` end to end: a prefill worker process serving bf16 weights refuses a
float32 decode side at the KV-transfer handshake (naming the weights' dtype of both), and sends a bf16
decode side the records and first token the bf16 model computes."""

from __future__ import annotations

import pytest
import torch
from prefill_rig import BLOCK, WorkerProcess, decode_target, make_receiver

from cedserve.kv_transfer.errors import CompatibilityError
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.paged_kv import load_state
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.worker_model import load_worker_model

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
ROUTED: dict[str, object] = {"effort": 75, "sampling": wpb.SamplingParams(top_p=1.0)}
MARGIN = 0.1
"""A token the worker picks that is not the in-process model's argmax must be this close to it (the
same bf16 weights; the worker encodes in chunks)."""


def test_bf16_prefill_worker_refuses_float32_and_serves_bf16() -> None:
    torch.set_num_threads(1)
    loaded = load_worker_model(None, "tiny", seed=0, dtype="bfloat16")  # the worker's weights, bit for bit
    model = loaded.model
    worker = WorkerProcess(flags=("--dtype=bfloat16",))
    receivers = {d: make_receiver(f"decode-{d}", 16, model.config, d) for d in ("float32", "bfloat16")}
    try:
        with pytest.raises(CompatibilityError, match="weights: float32 vs bfloat16"):
            receivers["float32"][0].handshake(worker.ready["control_address"])
        agent, pool = receivers["bfloat16"]
        agent.handshake(worker.ready["control_address"])
        tokens = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(4)).tolist()
        blocks = list(range(-(-len(tokens) // BLOCK)))
        res = agent.receiver().reserve("lease-a", blocks, sender=worker.ready["agent"], lease_s=20)
        req = wpb.PrefillRequest(
            request_id="a",
            token_ids=tokens,
            target=decode_target(res, agent.name, agent.control_address),
            **ROUTED,
        )
        events = list(worker.stub.Prefill(req, timeout=60))
        assert [e.WhichOneof("event") for e in events] == ["first_token", "done"]
        assert agent.receiver().wait("lease-a", 10).state.value == "done"
        logits = model.prefill(tokens, model.new_state())[-1]
        first = events[0].first_token.token_id
        assert float(logits.max() - logits[first]) <= MARGIN
        state = model.new_state()  # the received records continue as the bf16 model's own
        load_state(BlockLayout.from_config(model.config, BLOCK), pool, blocks, len(tokens), state)
        state.position = len(tokens)
        replayed = model.replay(tokens[-128:], state)[-1]
        assert float(replayed.max() - replayed[first]) <= MARGIN
    finally:
        worker.close()
        for agent, _ in receivers.values():
            agent.close()
