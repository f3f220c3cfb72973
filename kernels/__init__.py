"""Pure ops on the compact cache and the experts: Triton kernels, typed launchers, torch references.

`reference` (record formats and quantizers), `paged` (slot addressing), `records` (record writers
and readers), `compressor` (CSA2 compressor and index-key writer), `indexer` (scores and the
two-level top-k), `sparse_attention` (decode and chunked-prefill attention), `moe` (expert GEMMs),
`weight_formats` (checkpoint FP8/FP4 weights), `triton_support` (where kernels run). Importing any
of them never imports triton; see docs/kernels.md.
"""
