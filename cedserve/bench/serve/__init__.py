"""The serving benchmark behind `cedserve bench serve` (docs/bench-serve.md).

Reading order: `trace.py` (the Mooncake trace format, token synthesis, the prefix-reuse oracle),
`agentic.py` (synthetic agent sessions written as a trace), `driver.py` (load points and the
timed requests over the public API), `metrics.py` (summaries and invariants), `systems.py` (the
compared arms, started by the embedded launcher), `report.py` (table, JSON, plots), `main.py`
(the command line).
"""
