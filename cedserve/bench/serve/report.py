"""The bench's outputs: a terminal table, the JSON report, and PNG plots written beside it.

Report layout (JSON): `date`, `command`, `machine`, `workload` (its parameters and trace stats),
`slo`, `arms`: a list of {`arm`: topology and policy, `runs`: one per load point, each with
`load`, `summary` (metrics.summarize), `by_effort`, `invariant_violations` and `requests` (one row per
request: the latency CDFs can be redrawn from it)}.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


_HEADER = (f"{'arm':<14} {'load':<15} {'class':<5} {'sent':>5} {'ok':>5} {'err':>4} {'TTFT p50':>8} {'p99':>6} "
           f"{'TPOT p50':>8} {'p99':>5} {'E2E p50':>7} {'p99':>6} {'goodput':>7} {'SLO%':>5} {'hit%':>5} "
           f"{'orcl%':>5} {'KV MB':>7} {'KV GB/s':>7} {'D-only':>6}")


def _row(arm: str, load: str, klass: str, s: dict[str, Any]) -> str:
    gbps = s["kv_transfer_gbps"]
    return (f"{arm:<14} {load:<15} {klass:<5} {s['sent']:>5} {s['completed']:>5} {s['errored']:>4} "
            f"{_ms(s['ttft_s']['p50']):>8} {_ms(s['ttft_s']['p99']):>6} {_ms(s['tpot_s']['p50']):>8} "
            f"{_ms(s['tpot_s']['p99']):>5} {_s(s['e2e_s']['p50']):>7} {_s(s['e2e_s']['p99']):>6} "
            f"{s['goodput_rps']:>7.2f} {s['slo_attainment'] * 100:>5.0f} {s['hit_rate'] * 100:>5.1f} "
            f"{s['oracle_hit_rate'] * 100:>5.1f} {s['kv_transfer_bytes'] / 1e6:>7.2f} "
            f"{'-' if gbps is None else f'{gbps:.3g}':>7} {s['decode_only_fraction'] * 100:>5.0f}%")


def render_table(report: dict[str, Any]) -> str:
    """One row per (arm, load point), then one per effort class under it. TTFT/TPOT in ms, E2E in s,
    goodput in requests/s meeting the SLO, hit% / orcl% = cached / oracle-reusable prompt tokens."""
    lines = [_HEADER, "-" * len(_HEADER)]
    for arm in report["arms"]:
        for run in arm["runs"]:
            lines.append(_row(arm["arm"]["name"], run["load"]["label"], "all", run["summary"]))
            for klass, s in run["by_effort"].items():
                lines.append(_row("", "", klass, s))
            if run.get("unsent"):
                lines.append(f"  {run['unsent']} of {run['expected']} requests unsent (--max-run-s reached)")
            for bad in run["invariant_violations"]:
                lines.append(f"  INVARIANT VIOLATED: {bad}")
    slo = report["slo"]
    e2e = f", E2E <= {slo['e2e_s']:g} s" if slo["e2e_s"] else ""
    lines.append(f"SLO: TTFT <= {slo['ttft_s'] * 1000:.0f} ms, TPOT <= {slo['tpot_s'] * 1000:.0f} ms{e2e}; "
                 "hit% = prompt tokens served from a prefix cache, orcl% = the best any placement could reach")
    return "\n".join(lines)


def request_rows(results: list[Any]) -> list[dict[str, Any]]:
    keys = ("session", "turn", "effort", "prompt_tokens", "max_tokens", "output_tokens", "cached_tokens",
            "oracle_cached_tokens", "sent_s", "ttft_s", "e2e_s", "kv_transfer_bytes", "kv_transfer_s",
            "kv_transfer_tail_s", "decode_only", "server_s", "error")
    rows = []
    for r in results:
        row = {k: getattr(r, k) for k in keys}
        row["tpot_s"] = r.tpot_s
        row["api_overhead_s"] = r.api_overhead_s
        rows.append({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def write_plots(report: dict[str, Any], stem: Path) -> list[Path]:
    """`<stem>-latency-cdf.png`, `<stem>-goodput.png`, `<stem>-hit-rate.png`; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    arms = report["arms"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, unit, scale in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("ms", "ms", "s"), (1000, 1000, 1)):
        for arm in arms:
            for run in arm["runs"]:
                values = sorted(r[key] * scale for r in run["requests"] if r[key] is not None)
                if values:
                    ys = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, ys, where="post", label=f"{arm['arm']['name']} {run['load']['label']}")
        ax.set_xlabel(f"{key.removesuffix('_s').upper()} ({unit})")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency CDFs (completed requests)")
    fig.tight_layout()
    written.append(_save(fig, stem, "latency-cdf"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm in arms:
        points = [(run["load"]["value"], run["summary"]["goodput_rps"], run["load"]["kind"]) for run in arm["runs"]]
        for kind in sorted({p[2] for p in points}):
            xs = [p[0] for p in points if p[2] == kind]
            ys = [p[1] for p in points if p[2] == kind]
            ax.plot(xs, ys, marker="o", label=f"{arm['arm']['name']} ({kind})")
    ax.set_xlabel("offered load (sessions/s for poisson, sessions in flight for closed)")
    ax.set_ylabel("goodput (requests/s meeting the SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, stem, "goodput"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(arms) + 2), 4.2))
    labels, hits, oracles = [], [], []
    for arm in arms:
        for run in arm["runs"]:
            labels.append(f"{arm['arm']['name']}\n{run['load']['label']}")
            hits.append(run["summary"]["hit_rate"] * 100)
            oracles.append(run["summary"]["oracle_hit_rate"] * 100)
    slots = range(len(labels))
    ax.bar([x - 0.2 for x in slots], hits, width=0.4, label="measured (cached / prompt tokens)")
    ax.bar([x + 0.2 for x in slots], oracles, width=0.4, label="oracle (one unbounded cache)")
    ax.set_xticks(list(slots))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_ylim(0, 118)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, stem, "hit-rate"))
    plt.close(fig)
    return written


def _save(fig: Any, stem: Path, name: str) -> Path:
    path = stem.with_name(f"{stem.name}-{name}.png")
    fig.savefig(path, dpi=110)
    return path
