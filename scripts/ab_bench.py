#!/usr/bin/python3
"""Interleaved A/B of one Google Benchmark executable built from two trees.

    scripts/ab_bench.py OLD_BINARY NEW_BINARY [--filter REGEX] [--rounds 7]
                        [--min-time 0.2] [--pin 1] [--json OUT] [-- EXTRA ARGS]

Runs OLD, NEW, OLD, NEW, ... (--rounds pairs) with the same filter, pinned with taskset to
one core (--pin; '' for none), and prints for every benchmark both builds ran the median
real time of each and the median of the per-round ratios NEW / OLD (a ratio under 1: NEW
is faster). Pairing round by round keeps the ratio meaningful while the machine's speed
drifts; the spread (min and max ratio) says how noisy it was. --json writes the table.
"""
import argparse
import json
import statistics
import subprocess
import sys


def run(binary, args):
    out = subprocess.run(
        binary + args + ["--benchmark_format=json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    times = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration":
            continue
        times[b["name"]] = b["real_time"]
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--filter", default=".")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-time", default="0.2")
    parser.add_argument("--pin", default="1")
    parser.add_argument("--json")
    parser.add_argument("extra", nargs="*")
    a = parser.parse_args()
    prefix = ["taskset", "-c", a.pin] if a.pin else []
    args = [f"--benchmark_filter={a.filter}", f"--benchmark_min_time={a.min_time}"] + a.extra
    old_runs, new_runs = [], []
    for r in range(a.rounds):
        old_runs.append(run(prefix + [a.old], args))
        new_runs.append(run(prefix + [a.new], args))
        print(f"round {r + 1}/{a.rounds}", file=sys.stderr)
    names = [n for n in old_runs[0] if all(n in x for x in old_runs + new_runs)]
    rows = []
    for n in names:
        ratios = [new[n] / old[n] for old, new in zip(old_runs, new_runs)]
        rows.append({
            "name": n,
            "old": statistics.median(x[n] for x in old_runs),
            "new": statistics.median(x[n] for x in new_runs),
            "ratio": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        })
    width = max([len(r["name"]) for r in rows] + [9])
    print(f"{'benchmark':<{width}}  {'old':>12}  {'new':>12}  new/old  (min-max)")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['old']:12.4g}  {r['new']:12.4g}  {r['ratio']:7.3f}"
              f"  ({r['min']:.3f}-{r['max']:.3f})")
    if rows:
        print(f"median of the medians: {statistics.median(r['ratio'] for r in rows):.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"old": a.old, "new": a.new, "filter": a.filter, "rounds": a.rounds,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
