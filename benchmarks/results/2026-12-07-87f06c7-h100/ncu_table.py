"""Call K1: ncu's --csv --page raw output as one table, a column a profiled launch (in the
order benchmarks/ncu_one_row.py launches them), the stall reasons over 0.05 cycles a issue."""
import csv
import sys

LABELS = sys.argv[2].split(",") if len(sys.argv) > 2 else [
    "gate_up fp8", "gate_up bf16", "gate_up read", "down fp8", "down bf16", "down read"]
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
names, launches = rows[head], [r for r in rows[head + 2:] if r and r[0].isdigit()]
print("launches:", [(r[names.index("Kernel Name")])[:40] for r in launches])
KEEP = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct", "lts__t_sector_hit_rate.pct",
        "sm__warps_active.avg.pct", "launch__registers_per_thread", "launch__grid_size",
        "launch__occupancy_limit", "smsp__inst_executed.sum", "smsp__cycles_active.", "sm__cycles_elapsed.avg",
        "smsp__average_warps_issue_stalled")
cols = [n for n in names if n.startswith(KEEP)]
print("| metric | " + " | ".join(LABELS[:len(launches)]) + " |")
for c in cols:
    vals = [r[names.index(c)] for r in launches]
    if "stalled" in c:
        try:
            if max(float(v.replace(",", "")) for v in vals) < 0.05:
                continue
        except ValueError:
            pass
        c = c.replace("smsp__average_warps_issue_stalled_", "stall ").replace("_per_issue_active.ratio", "")
    print(f"| {c} | " + " | ".join(vals) + " |")
