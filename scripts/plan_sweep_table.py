#!/usr/bin/env python3
"""Tables of bench_plan's plan_sweep from its JSON output (docs/performance.md).

    build/dev/bench/bench_plan --benchmark_out=results/plan_sweep.json --benchmark_out_format=json
    scripts/plan_sweep_table.py results/plan_sweep.json

Prints, for each instruction set and K/V storage, the worst and the median of automatic's time
over the fastest explicit algorithm's, and a grid per instruction set and storage: the fastest
algorithm at each (Lq, Lk) for Hq = Hkv and for GQA 32/8 (n naive, c chunked, f flash, d
decode), with a * where automatic chose another one.
"""
import json
import statistics
import sys
from collections import defaultdict

ALGORITHMS = ["naive", "chunked", "flash", "decode"]


def load(path):
    with open(path) as f:
        data = json.load(f)
    shapes = []
    for b in data["benchmarks"]:
        if not b["name"].startswith("plan_sweep/"):
            continue
        parts = b["name"].split("/")
        args = dict(p.split(":") for p in parts[2:] if ":" in p)
        times = {a: b["t_" + a] for a in ALGORITHMS + ["automatic"]}
        chosen = b["label"].split("auto=")[1].split()[0]
        shapes.append({
            "isa": parts[1], "kv": "half" if args["half"] == "1" else "float",
            "Hq": int(args["Hq"]), "Lq": int(args["Lq"]), "Lk": int(args["Lk"]),
            "times": times, "chosen": chosen, "ratio": b["auto_over_best"],
        })
    return data.get("context", {}), shapes


def main():
    context, shapes = load(sys.argv[1])
    print(f"{context.get('date', '')}, {context.get('num_cpus', '?')} CPUs; "
          f"{len(shapes)} shapes\n")
    groups = defaultdict(list)
    for s in shapes:
        groups[(s["isa"], s["kv"])].append(s)
    print("| instruction set | K/V | shapes | automatic / fastest explicit: median | worst (Hq, Lq, Lk) |")
    print("|---|---|---|---|---|")
    for (isa, kv), group in sorted(groups.items()):
        worst = max(group, key=lambda s: s["ratio"])
        median = statistics.median(s["ratio"] for s in group)
        print(f"| {isa} | {kv} | {len(group)} | {median:.2f} | {worst['ratio']:.2f} "
              f"({worst['Hq']}, {worst['Lq']}, {worst['Lk']}) |")
    for (isa, kv), group in sorted(groups.items()):
        lks = sorted({s["Lk"] for s in group})
        lqs = sorted({s["Lq"] for s in group})
        cells = {(s["Hq"], s["Lq"], s["Lk"]): s for s in group}
        print(f"\n{isa}, {kv} K/V: the fastest algorithm for Hq = 8 / Hq = 32 (Hkv = 8); "
              "* where automatic chose another\n")
        print("| Lq \\ Lk | " + " | ".join(str(lk) for lk in lks) + " |")
        print("|---|" + "---|" * len(lks))
        for lq in lqs:
            row = []
            for lk in lks:
                marks = []
                for hq in (8, 32):
                    s = cells.get((hq, lq, lk))
                    if s is None:
                        marks.append("-")
                        continue
                    fastest = min(ALGORITHMS, key=lambda a: s["times"][a])
                    marks.append(fastest[0] + ("*" if s["chosen"] != fastest else ""))
                row.append(" / ".join(marks))
            print(f"| {lq} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
