#!/usr/bin/env python3
"""Flash attention per instruction set, as a share of that instruction set's FMA probe.

Reads Google Benchmark JSON files written by bench_attention (one or more runs of a build
with -march=native and of a build without it, filtered to fma_peak and flash_isa) and
prints one Markdown table: GFLOP/s, the share of the probe measured in the same run (for
generic: the probe of the widest instruction set, the machine's ceiling), the causal
speed-up (time of the non-causal run over the causal one) and the plain build's speed over
the native build's, as raw rates and as shares of each run's own probe (which cancels a
machine that was busier during one of the runs). Medians over the runs given.

  scripts/isa_table.py --native dev.*.json --plain portable.*.json
"""
import argparse
import json
import re
import statistics
from collections import defaultdict

ISAS = ["generic", "avx2", "avx512"]


def load(paths):
    """{(name-without-repeat-suffix): [values...]} for rate and time."""
    rates, times = defaultdict(list), defaultdict(list)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data["benchmarks"]:
            if b.get("run_type") == "aggregate" or b.get("error_occurred"):
                continue
            name = b["name"].replace("/real_time", "")
            rates[name].append(b.get("FLOPS", 0.0))
            times[name].append(b["real_time"])
    return ({k: statistics.median(v) for k, v in rates.items()},
            {k: statistics.median(v) for k, v in times.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--native", nargs="+", required=True)
    ap.add_argument("--plain", nargs="+", required=True)
    args = ap.parse_args()
    native_rate, native_time = load(args.native)
    plain_rate, plain_time = load(args.plain)

    def probe(rates, isa):
        key = "fma_peak/threads:1" if isa == "generic" else f"fma_peak_isa/{isa}/threads:1"
        return rates.get(key)

    print("| isa | L | D | causal | GFLOP/s (plain build) | share of probe | causal speed-up |"
          " plain / native | same, in shares of each run's probe |")
    print("|---|---|---|---|---|---|---|---|---|")
    pattern = re.compile(r"flash_isa/isa:(\d)/L:(\d+)/D:(\d+)/causal:(\d)/threads:1$")
    rows = []
    for name in plain_rate:
        m = pattern.match(name)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), name))
    for isa, length, dim, causal, name in sorted(rows):
        isa_name = ISAS[isa]
        rate = plain_rate[name]
        peak = probe(plain_rate, isa_name)
        share = f"{100 * rate / peak:.0f}%" if peak else "-"
        speedup = "-"
        if causal:
            base = name.replace("causal:1", "causal:0")
            if base in plain_time:
                speedup = f"{plain_time[base] / plain_time[name]:.2f}x"
        ratio = f"{rate / native_rate[name]:.2f}" if name in native_rate else "-"
        native_peak = probe(native_rate, isa_name)
        shares = (f"{(rate / peak) / (native_rate[name] / native_peak):.2f}"
                  if name in native_rate and peak and native_peak else "-")
        print(f"| {isa_name} | {length} | {dim} | {causal} | {rate / 1e9:.1f} | {share} |"
              f" {speedup} | {ratio} | {shares} |")
    print()
    print("probes (plain build): " + ", ".join(
        f"{isa} {probe(plain_rate, isa) / 1e9:.0f} GFLOP/s" for isa in ISAS if probe(plain_rate, isa)))


if __name__ == "__main__":
    main()
