"""The model's memory: paged global-KV blocks, prefix cache, tiers, KV events and SWA rings.

Reading order (docs/cache.md has the byte tables and the reasoning):

| module | what |
|---|---|
| `layout` | `BlockLayout`: byte offsets of every KV-source layer's records inside a block (a format contract) |
| `block_pool` | `BlockPool`: one `uint8 [num_blocks, block_bytes]` tensor, refcounts, free-extent allocator |
| `hashing` | chained, salted sha256 block hashes (shared with the router; no torch) |
| `prefix` | `PrefixCache`: hash -> block, longest cached run, LRU of unreferenced blocks |
| `tiers`, `disk_format`, `background` | host tier, checksummed disk tier, its I/O thread |
| `events` | `BlockStored` / `BlockRemoved` / `BlockTierChanged` batches with sequence numbers (no torch) |
| `manager` | `KVCacheManager`: a worker's cache, request by request |
| `swa` | `SWAPool`: bounded SWA rings and compressor partial groups, with rollback |
| `config`, `metrics`, `errors` | `KVCacheConfig`, `CacheMetrics` (+ Prometheus collector), typed errors |

Nothing is imported here, so `cedserve.model.cache.events` and `.hashing` load without torch.
"""
