"""Stall samples of a kernel by SASS instruction, from `ncu -i REPORT --page source --csv --print-source sass`:
the 45 instructions with the most samples and the share of each opcode.

    python parse_ncu_source.py source.csv
"""
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h0 = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
hdr = rows[h0]
si, ni, src = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Warp Stall Sampling (Not-issued Samples)"), hdr.index("Source")
data = [r for r in rows[h0 + 1:] if len(r) >= len(hdr) - 1 and r[si].replace(".", "").isdigit()]
tot = sum(float(r[si]) for r in data)
print("total samples", tot, "instructions", len(data))
for r in sorted(data, key=lambda r: -float(r[si]))[:45]:
    print(f"{float(r[si])/tot*100:5.1f}% {r[0]:>6} {r[src][:100]}")
kinds = {}
for r in data:
    parts = r[src].split()
    if not parts: continue
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    op = op.split(".")[0]
    kinds[op] = kinds.get(op, 0) + float(r[si])
print(sorted(((round(v / tot * 100, 1), k) for k, v in kinds.items()), reverse=True)[:24])
