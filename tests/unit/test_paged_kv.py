"""Global KV records travel between a sequence's state and paged blocks byte for byte, and a state
rebuilt from blocks plus replay decodes exactly like the original."""

from __future__ import annotations

import torch

from cedserve.model.cache.block_pool import BlockPool
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.paged_kv import load_state, store_records, store_state
from cedserve.model.presets import preset
from cedserve.model.tokenizer import tiny_tokenizer_path


def test_blocks_round_trip_and_decode_after_replay() -> None:
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())
    model, _ = random_model(config, tiny_tokenizer_path(), seed=4)
    layout = BlockLayout.from_config(config, block_size=16)
    pool = BlockPool(32, layout.block_bytes)
    pool.storage.fill_(0xAB)  # poison: every record read back must have been written
    tokens = torch.randint(3, config.vocab_size, (77,), generator=torch.Generator().manual_seed(9)).tolist()
    blocks = pool.allocate(-(-len(tokens) // 16), "r1")

    # Prefill side: encode in two chunks, storing each chunk's new records as it is produced.
    sender = model.new_state()
    for chunk in (tokens[:40], tokens[40:]):
        store_records(layout, pool.storage, blocks, model.encode_chunk(chunk, sender).global_kv)

    # Decode side: global KV from the blocks, then replay the whole prompt for exact windows.
    receiver = model.new_state()
    load_state(layout, pool.storage, blocks, len(tokens), receiver)
    for layer, kv in sender.global_kv.items():
        assert torch.equal(receiver.global_kv[layer].main, kv.main), layer
        assert torch.equal(receiver.global_kv[layer].index_keys, kv.index_keys), layer
    receiver.position = len(tokens)
    replayed = model.replay(tokens, receiver)[-1]

    reference = model.new_state()
    expected = model.prefill(tokens, reference)[-1]
    assert torch.allclose(replayed, expected, atol=1e-5, rtol=0)
    nxt = int(expected.argmax())
    assert torch.allclose(model.decode_step([nxt], [receiver]), model.decode_step([nxt], [reference]),
                          atol=1e-5, rtol=0)

    # store_state writes the same bytes as the chunk-by-chunk stores did.
    other = BlockPool(32, layout.block_bytes)
    store_state(layout, other.storage, blocks, sender)
    for layer in sender.global_kv:
        for kind in ("main", "index"):
            a = layout.pool_view(pool.storage, layer, kind)[blocks]
            b = layout.pool_view(other.storage, layer, kind)[blocks]
            used = len(sender.global_kv[layer].main)
            assert torch.equal(a.flatten(0, 1)[:used], b.flatten(0, 1)[:used])
