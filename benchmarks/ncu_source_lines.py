"""Warp-stall samples of one kernel per source line (and per SASS address range), from Nsight
Compute's source page and the kernel's own cubin.

On the GPU host:

    ncu --clock-control none -k regex:_gl_sparse --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o /tmp/att \\
        python3 -P benchmarks/kernel_profile.py --only attention --tokens 64
    ncu -i /tmp/att.ncu-rep --page source --csv --print-source sass > src.csv
    cp "$(find / -name '_gl_sparse_attention_kernel.cubin' | head -1)" .

Anywhere with Triton's nvdisasm (`pip install triton`: triton/backends/nvidia/bin/nvdisasm):

    nvdisasm -gi -c _gl_sparse_attention_kernel.cubin > kernel.li
    python benchmarks/ncu_source_lines.py src.csv kernel.li [--ranges 0:1200,1200:3c40,...]

The source page lists each SASS instruction with its samples and stall reasons; nvdisasm's line
table maps the same addresses (offsets from the kernel's first instruction) to source lines, with
inlined helpers attributed to their own lines. kernels-notes.md (v16, v17) used this to place
v11's time (the decode, the slot division, the epilogue)."""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from pathlib import Path

_SAMPLES = "Warp Stall Sampling (All Samples)"


def line_table(li_path: Path) -> dict[int, tuple[str, int]]:
    """SASS offset -> (file name, line) from `nvdisasm -gi -c` output."""
    table: dict[int, tuple[str, int]] = {}
    current = ("?", 0)
    for text in li_path.read_text().splitlines():
        found = re.search(r'//## File "(.*?)", line (\d+)', text)
        if found:
            current = (Path(found.group(1)).name, int(found.group(2)))
            continue
        insn = re.match(r"\s+/\*([0-9a-f]+)\*/\s", text)
        if insn:
            table[int(insn.group(1), 16)] = current
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source_csv", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("line_info", type=Path, help="nvdisasm -gi -c output for the same cubin")
    parser.add_argument("--top", type=int, default=30, help="source lines to print")
    parser.add_argument("--ranges", default="", help="hex SASS offset ranges lo:hi,... to total separately")
    args = parser.parse_args()
    rows = list(csv.reader(args.source_csv.open()))
    header = next((r for r in rows if r and r[0] == "Address"), None)
    if header is None or _SAMPLES not in header:
        print(f"{args.source_csv}: no source-page table with '{_SAMPLES}' (collect SourceCounters)")
        return 2
    data = rows[rows.index(header) + 1:]
    base = int(data[0][0], 16)
    lines = line_table(args.line_info)
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    per_line: dict[tuple[str, int], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    ranges = [tuple(int(x, 16) for x in r.split(":")) for r in args.ranges.split(",") if r]
    per_range: collections.Counter[tuple[int, ...]] = collections.Counter()
    for row in data:
        offset = int(row[0], 16) - base
        samples = int(row[header.index(_SAMPLES)] or 0)
        counts = per_line[lines.get(offset, ("?", 0))]
        counts["samples"] += samples
        counts["executed"] += int(row[header.index("Instructions Executed")] or 0)
        for name in stalls:
            counts[name[6:]] += int(float(row[header.index(name)] or 0))
        totals["samples"] += samples
        for r in ranges:
            if r[0] <= offset < r[1]:
                per_range[r] += samples
    print(f"{totals['samples']} samples")
    for r in ranges:
        print(f"  {r[0]:#x}..{r[1]:#x}: {per_range[r]} ({100 * per_range[r] / max(totals['samples'], 1):.1f} %)")
    for (name, line), counts in sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        reasons = ", ".join(f"{k}={v}" for k, v in counts.most_common() if k not in ("samples", "executed") and v)
        share = 100 * counts["samples"] / max(totals["samples"], 1)
        print(f"{counts['samples']:6d} {share:5.1f} %  {name}:{line}  executed {counts['executed']}  | {reasons[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
