"""The report of the weight-streaming sweeps (bench_fp8_gemv.py, bench_fp8_skinny.py): each
variant's time against the floor of the FP8 weight's bytes at a nominal bandwidth, and the
fastest variant per (shape, rows) as a markdown table to paste into docs/fp8.md.

At a few rows a product reads its weight once and little else, so its floor is the weight's
bytes over the memory's bandwidth; 3.0 TB/s is an H100 SXM's measured copy bandwidth
(bench_gemv.py's `copy_bandwidth`: 3.01), the same nominal figure for every variant and row
count so that the columns compare. Results are dicts with `shape`, `m`, `impl`, `us` (absent
for a failed variant) and `floor_us`.
"""
from __future__ import annotations

FLOOR_TBS = 3.0


def floor_us(nbytes: float, tbs: float = FLOOR_TBS) -> float:
    """Microseconds to read `nbytes` at `tbs` TB/s."""
    return nbytes / (tbs * 1e12) * 1e6


def best_table(results: list[dict], default: str, baselines: list[str], tbs: float = FLOOR_TBS) -> str:
    """Markdown: per (shape, rows) the fastest variant other than the baselines, its time and
    x floor, the default's, and each baseline's time (x floor)."""
    head = ["shape", "rows", "fastest", "us", "x floor", f"{default} us", f"{default} x floor",
            *(f"{b} us (x floor)" for b in baselines)]
    lines = [f"floor: the FP8 weight's bytes at {tbs:.1f} TB/s",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["shape"], r["m"]) for r in results))
    for shape, m in keys:
        here = {r["impl"]: r for r in results if r["shape"] == shape and r["m"] == m and r.get("us") is not None}
        cands = {k: r for k, r in here.items() if k not in baselines}
        if not cands:
            continue
        best = min(cands.values(), key=lambda r: r["us"])
        d = here.get(default)
        cells = [shape, str(m), best["impl"], f"{best['us']:.2f}", f"{best['us'] / best['floor_us']:.2f}",
                 f"{d['us']:.2f}" if d else "-", f"{d['us'] / d['floor_us']:.2f}" if d else "-"]
        for b in baselines:
            r = here.get(b)
            cells.append(f"{r['us']:.2f} ({r['us'] / r['floor_us']:.2f})" if r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
