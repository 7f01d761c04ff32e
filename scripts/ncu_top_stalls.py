"""The SASS instructions with the most warp stall samples, from Nsight Compute's source page as CSV
(`ncu -i REP.ncu-rep --page source --csv --print-source sass > src.csv`).

    python3 scripts/ncu_top_stalls.py src.csv [--top 40]
Prints each instruction's share of all samples, its two largest stall reasons and the SASS text.
"""
import argparse
import csv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    with open(a.csv, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    head, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    col = {name: i for i, name in enumerate(head)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [i for i, n in enumerate(head) if n.startswith("stall_") and "Not Issued" not in n]

    def num(x):
        try:
            return float(x)
        except ValueError:
            return 0.0

    total = sum(num(r[samples]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples")
    for r in sorted(body, key=lambda r: -num(r[samples]))[: a.top]:
        top2 = sorted(reasons, key=lambda i: -num(r[i]))[:2]
        why = ", ".join(f"{head[i][6:]} {num(r[i]) / total:.1%}" for i in top2 if num(r[i]) > 0)
        print(f"{num(r[samples]) / total:6.1%}  {r[col['Address']]:>6}  {r[col['Source']][:70]:<70}  {why}")


if __name__ == "__main__":
    main()
