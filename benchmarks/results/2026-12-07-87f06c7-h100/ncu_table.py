"""Call K1: ncu's --csv --page raw output as one table, a column a profiled launch (in the
order benchmarks/ncu_one_row.py launches them), the stall reasons over 0.05 cycles a issue."""
import csv
import sys

LABELS = ["gate_up fp8", "gate_up bf16", "gate_up read", "down fp8", "down bf16", "down read"]
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
names, launches = rows[head], [r for r in rows[head + 2:] if r and r[0].isdigit()]
print("launches:", [(r[names.index("Kernel Name")])[:40] for r in launches])
cols = [n for n in names if "__" in n]
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
