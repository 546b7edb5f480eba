#!/usr/bin/env python3
"""ggml's decode timings (the lines fa_decode prints) as a Google-Benchmark-shaped JSON file,
so that scripts/perf_tables.py reads them beside bench_decode's decode_formats:

    bench/peers/ggml/run.sh | bench/peers/ggml/to_json.py > results/ggml_decode.json

Each line `type=Q8_0 Lk=32768 Hq=32 Hkv=8 threads=1 median_us=... kv_GBps=...` becomes a
benchmark `ggml_flash_attn_ext/type:Q8_0/Lk:32768/Hq:32/Hkv:8/threads:1` with real_time in
microseconds and KV_bytes, the stored bytes of K and V read per second.
"""
import datetime
import json
import os
import re
import sys

LINE = re.compile(r"type=(\w+) Lk=(\d+) Hq=(\d+) Hkv=(\d+) threads=(\d+) median_us=([\d.]+) "
                  r"kv_GBps=([\d.]+)")


def main():
    benchmarks = []
    for line in sys.stdin:
        m = LINE.match(line.strip())
        if not m:
            continue
        kind, lk, hq, hkv, threads, median, gbps = m.groups()
        name = f"ggml_flash_attn_ext/type:{kind}/Lk:{lk}/Hq:{hq}/Hkv:{hkv}/threads:{threads}"
        benchmarks.append({"name": name, "run_name": name, "run_type": "iteration",
                           "repetitions": 1, "real_time": float(median), "time_unit": "us",
                           "KV_bytes": float(gbps) * 1e9})
    context = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "load_avg": list(os.getloadavg()), "num_cpus": os.cpu_count()}
    json.dump({"context": context, "benchmarks": benchmarks}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
