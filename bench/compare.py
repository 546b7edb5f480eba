#!/usr/bin/python3
"""Benchmarks attn beside its peers, in one run, and writes one table and one plot.

    /usr/bin/python3 bench/compare.py [--bench-dir build/dev/bench] [--results results]
                                      [--threads 1 2] [--lengths 512 1024 2048 4096]

Debian's python3-numpy, python3-torch (1.13) and python3-matplotlib; no pip. Steps:

1. ours: runs bench_attention (fma_peak; flash, naive and Eigen's GEMM at D = 64,
   non-causal, each L and thread count) and bench_multihead (once per thread count, with
   OMP_NUM_THREADS) with --benchmark_out=<results>/<name>.json; reads those JSON files.
2. peers: for each thread count, a fresh Python process (this file with --peer-worker) with
   OPENBLAS_NUM_THREADS / OMP_NUM_THREADS / MKL_NUM_THREADS set before NumPy and torch are
   imported (NumPy and torch both call Debian's OpenBLAS here, whose pool is sized at load
   time), plus torch.set_num_threads(n). It times, at the same shapes, float32:
     - the tutorial's NumPy attention (the self-attention tutorial's `self_attention` without its projections:
       np.dot(Q, K.T), divide by np.sqrt(d_k), the tutorial's `softmax`, np.dot(weights, V)),
       called once per head for B * H = 8 heads, as the tutorial's 2-D function must be;
     - PyTorch bmm-softmax-bmm on (8, L, 64) tensors;
     - torch.nn.functional._scaled_dot_product_attention (private in torch 1.13) if present;
     - multi-head attention at E = 768, H = 12, B = 8, S = 512: the tutorials' NumPy path
       (the QKV-projection tutorial's `BatchQKVProjection.forward`: X @ W_q, X @ W_k, X @ W_v, reshape and
       transpose to heads; the self-attention tutorial's attention per (batch, head); then merging the heads and
       an output projection X @ W_o, which the tutorials leave out but every MHA has) and
       torch.nn.MultiheadAttention(768, 12, batch_first=True) in eval mode under no_grad with
       need_weights=False, loaded with the same weights.
   Every peer is checked once against a float64 reference (attention: head 0; MHA: the NumPy
   path against nn.MultiheadAttention) before it is timed. A timing is the minimum over
   repeated calls after one warm-up call (at least 3 calls and 1 s, at most 10 calls).
3. writes <results>/benchmarks.md (one markdown table: implementation x L in GFLOP/s and %
   of the FMA peak measured in the same run, plus multi-head rows; the machine, the load
   average before the run, the cores other processes kept busy during it, date, versions
   and commands), <results>/attention_gflops.svg (GFLOP/s against L, one line per
   implementation and thread count, the FMA peaks as horizontal lines) and
   <results>/peers.json (the peers' raw timings).

FLOPs: attention 4 * B * H * L * L * D (q k^T and p v); the softmax is not counted. Eigen's
GEMM row is (L x 64)(64 x L) once per head: half of attention's FLOPs, at the same rate scale.
Multi-head: 2 * N * E * 3E + 4 * B * H * S * S * D + 2 * N * E * E with N = B * S.
"""

import argparse
import datetime
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time

HEADS = 8  # B * H for the attention rows (B = 1, H = 8), as in bench_attention
HEAD_DIM = 64
MHA = {"batch": 8, "seq": 512, "embed": 768, "heads": 12}


def attention_flops(length, heads=HEADS, dim=HEAD_DIM):
    return 4.0 * heads * length * length * dim


def mha_flops(batch, seq, embed, heads):
    rows = batch * seq
    return (2.0 * rows * embed * 3 * embed + 4.0 * batch * heads * seq * seq * (embed // heads) +
            2.0 * rows * embed * embed)


# --- peers (run inside the worker process) ----------------------------------------------

def best_time(function, min_calls=3, max_calls=10, min_seconds=1.0):
    """Minimum wall time of function() over repeated calls, after one warm-up call."""
    function()
    times = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < min_calls or
                                      time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        function()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_peers(threads, lengths):
    """Times the NumPy tutorial and PyTorch; returns a JSON-ready dict. Imports here, after
    the parent set the thread environment variables."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)

    # The tutorial's softmax (the self-attention tutorial, section 5), verbatim.
    def softmax(x):
        e_x = np.exp(x - np.max(x, axis=-1, keepdims=True))
        return e_x / e_x.sum(axis=-1, keepdims=True)

    # The tutorial's self_attention (the self-attention tutorial, section 8) after its three projections.
    def tutorial_attention(Q, K, V):
        attention_scores = np.dot(Q, K.T)
        scaled_attention_scores = attention_scores / np.sqrt(K.shape[-1])
        attention_weights = softmax(scaled_attention_scores)
        output = np.dot(attention_weights, V)
        return output, attention_weights

    def numpy_heads(q, k, v):  # (heads, L, D) each; the 2-D tutorial function per head
        out = np.empty_like(q)
        for h in range(q.shape[0]):
            out[h], _ = tutorial_attention(q[h], k[h], v[h])
        return out

    def reference_head(q, k, v):  # float64, one head
        s = q.astype(np.float64) @ k.astype(np.float64).T / np.sqrt(q.shape[-1])
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        return (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)

    sdpa = getattr(torch.nn.functional, "_scaled_dot_product_attention", None)
    results = {"threads": threads, "numpy": np.__version__, "torch": torch.__version__,
               "attention": {}, "mha": {}}
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for length in lengths:
            q, k, v = (rng.standard_normal((HEADS, length, HEAD_DIM), dtype=np.float32)
                       for _ in range(3))
            tq, tk, tv = (torch.from_numpy(t) for t in (q, k, v))
            scale = 1.0 / float(np.sqrt(HEAD_DIM))

            def torch_bmm():
                p = torch.softmax(torch.bmm(tq, tk.transpose(1, 2)) * scale, dim=-1)
                return torch.bmm(p, tv)

            candidates = {"NumPy tutorial": lambda: numpy_heads(q, k, v),
                          "PyTorch bmm-softmax-bmm": lambda: torch_bmm().numpy()}
            if sdpa is not None:
                candidates["PyTorch _scaled_dot_product_attention"] = \
                    lambda: sdpa(tq, tk, tv)[0].numpy()
            expected = reference_head(q[0], k[0], v[0])
            timings = {}
            for name, function in candidates.items():
                try:
                    error = float(np.max(np.abs(function()[0] - expected)))
                except Exception as exc:  # the private SDPA may not run: leave it out
                    print(f"compare.py: {name} failed ({exc}); left out", file=sys.stderr)
                    continue
                if not error < 1e-4:
                    raise SystemExit(f"compare.py: {name} at L = {length} differs from the "
                                     f"float64 reference by {error}")
                seconds = best_time(function)
                timings[name] = {"seconds": seconds, "max_error": error,
                                 "flops_per_second": attention_flops(length) / seconds}
            results["attention"][str(length)] = timings

        # Multi-head attention, the tutorial's batch.
        b, s, e, h = MHA["batch"], MHA["seq"], MHA["embed"], MHA["heads"]
        d = e // h
        x = rng.standard_normal((b, s, e), dtype=np.float32)
        std = np.sqrt(2.0 / (e + e))  # the QKV-projection tutorial's xavier_initialization
        w_q, w_k, w_v, w_o = (rng.standard_normal((e, e), dtype=np.float32) * np.float32(std)
                              for _ in range(4))

        def numpy_mha():
            # the QKV-projection tutorial's BatchQKVProjection.forward
            Q = (x @ w_q).reshape(b, -1, h, d).transpose(0, 2, 1, 3)
            K = (x @ w_k).reshape(b, -1, h, d).transpose(0, 2, 1, 3)
            V = (x @ w_v).reshape(b, -1, h, d).transpose(0, 2, 1, 3)
            heads = np.empty((b, h, s, d), dtype=np.float32)
            for i in range(b):  # the self-attention tutorial's 2-D attention per (batch, head)
                for j in range(h):
                    heads[i, j], _ = tutorial_attention(Q[i, j], K[i, j], V[i, j])
            return heads.transpose(0, 2, 1, 3).reshape(b, s, e) @ w_o

        mha = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([w_q.T, w_k.T, w_v.T])))
        mha.in_proj_bias.zero_()
        mha.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(w_o.T)))
        mha.out_proj.bias.zero_()
        tx = torch.from_numpy(x)

        def torch_mha():
            return mha(tx, tx, tx, need_weights=False)[0].numpy()

        expected = torch_mha()
        error = float(np.max(np.abs(numpy_mha() - expected)) / max(1.0, np.max(np.abs(expected))))
        if not error < 1e-4:
            raise SystemExit(f"compare.py: NumPy MHA and nn.MultiheadAttention differ by {error}")
        flops = mha_flops(b, s, e, h)
        for name, function in (("NumPy tutorial MHA", numpy_mha),
                               ("PyTorch nn.MultiheadAttention", torch_mha)):
            seconds = best_time(function)
            results["mha"][name] = {"seconds": seconds, "max_error": error,
                                    "flops_per_second": flops / seconds}
    return results


# --- ours ----------------------------------------------------------------------------

def run_benchmark(binary, out_path, arguments, env=None):
    command = [binary, f"--benchmark_out={out_path}", "--benchmark_out_format=json"] + arguments
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out_path) as f:
        return json.load(f), command


def rate(entry):
    return entry.get("FLOPS", entry.get("FLOP/s"))


# --- machine -----------------------------------------------------------------------------

def cpu_snapshot():
    """(wall s, busy CPU s of the whole machine, CPU s of this process and its waited-for
    children). Two snapshots give the cores that *other* processes kept busy in between,
    which the load average cannot: it counts our own benchmark threads too."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return time.monotonic(), busy, ours


def others_cores(before, after):
    """Average number of cores used by other processes between two cpu_snapshot()s."""
    wall = after[0] - before[0]
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall) if wall > 0 else 0.0


# --- report ------------------------------------------------------------------------------

def machine():
    model, cores = platform.processor() or "?", os.cpu_count()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        match = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
        model = match.group(1).strip() if match else model
    except (OSError, subprocess.CalledProcessError):
        pass
    return model, cores


def fmt_rate(flops, peak):
    if flops is None:
        return "-"
    return f"{flops / 1e9:.1f} ({100.0 * flops / peak:.0f}%)"


def write_report(args, ours, peers, commands, load, others):
    lengths, threads = args.lengths, args.threads
    peak = {n: rate(ours[("fma_peak", None, n)]) for n in threads}
    rows = []  # (label, threads, {length: flops}, mha_flops)
    for name, label in (("flash", "attn flash"), ("naive", "attn naive"),
                        ("gemm", "Eigen GEMM (L x 64)(64 x L), per head")):
        for n in threads:
            rows.append((label, n, {l: rate(ours[(name, l, n)]) for l in lengths}, None))
    peer_names = sorted({name for p in peers.values() for t in p["attention"].values()
                         for name in t}, key=lambda name: (not name.startswith("NumPy"), name))
    for name in peer_names:
        for n in threads:
            cells = {l: peers[n]["attention"][str(l)].get(name, {}).get("flops_per_second")
                     for l in lengths}
            rows.append((name, n, cells, None))
    for n in threads:
        rows.append(("attn MultiHeadAttention", n, {}, rate(ours[("mha_forward", None, n)])))
    for name in ("NumPy tutorial MHA", "PyTorch nn.MultiheadAttention"):
        for n in threads:
            rows.append((name, n, {}, peers[n]["mha"][name]["flops_per_second"]))

    model, cores = machine()
    p0 = peers[threads[0]]
    loaded = max(others.values()) > 0.25
    lines = [
        "# attn against NumPy and PyTorch",
        "",
        f"Machine: {model}, {cores} cores (`lscpu`), Linux {platform.release()}; "
        f"measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        f"Load average before the run: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / "
        f"15 min). Other processes kept {others['ours']:.2f} cores busy on average while attn "
        f"ran and {others['peers']:.2f} while NumPy and PyTorch ran (/proc/stat minus this "
        f"run's own CPU time)"
        + (": **the machine was shared during the run, so two-thread figures especially are "
           "low and noisy; compare within a column**." if loaded else "."),
        f"NumPy {p0['numpy']} and PyTorch {p0['torch']} (Debian), both on Debian's OpenBLAS.",
        "",
        f"Float32, GFLOP/s (and % of the FMA peak measured in the same run for that thread "
        f"count). Attention: B * H = {HEADS} heads, D = {HEAD_DIM}, non-causal, FLOPs = "
        f"4 * B * H * L * L * D. Multi-head: E = {MHA['embed']}, H = {MHA['heads']}, "
        f"B = {MHA['batch']}, S = {MHA['seq']} forward, projections included.",
        "",
        "| implementation | threads | " + " | ".join(f"L = {l}" for l in lengths)
        + f" | MHA B={MHA['batch']} S={MHA['seq']} |",
        "|---|---|" + "---|" * (len(lengths) + 1),
    ]
    for n in threads:
        cell = f"{peak[n] / 1e9:.0f}"
        lines.append(f"| FMA peak (probe) | {n} | " + " | ".join([cell] * (len(lengths) + 1))
                     + " |")
    for label, n, cells, mha in rows:
        lines.append(f"| {label} | {n} | "
                     + " | ".join(fmt_rate(cells.get(l), peak[n]) if cells else "-"
                                  for l in lengths)
                     + f" | {fmt_rate(mha, peak[n])} |")
    lines += ["", "Commands (this table was generated by `bench/compare.py`):", "", "```sh"]
    lines += [" ".join(c) for c in commands]
    lines += ["```", ""]
    with open(os.path.join(args.results, "benchmarks.md"), "w") as f:
        f.write("\n".join(lines))
    plot(args, rows, peak, model)


def plot(args, rows, peak, model):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.hashsalt"] = "attn"  # stable ids: the SVG changes only with the data
    figure, axes = plt.subplots(figsize=(8, 5))
    colours = {}
    for label, n, cells, _ in rows:
        if not cells:
            continue
        colour = colours.setdefault(label, f"C{len(colours)}")
        xs = [l for l in args.lengths if cells.get(l)]
        axes.plot(xs, [cells[l] / 1e9 for l in xs], marker="o", color=colour,
                  linestyle="-" if n == 1 else "--", label=f"{label}, {n} thread{'s' * (n > 1)}")
    for n in args.threads:
        axes.axhline(peak[n] / 1e9, color="black", linestyle=":" if n == 1 else "-.",
                     linewidth=1, label=f"FMA peak, {n} thread{'s' * (n > 1)}")
    axes.set_xscale("log", base=2)
    axes.set_xticks(args.lengths)
    axes.set_xticklabels([str(l) for l in args.lengths])
    axes.set_xlabel("sequence length L (B * H = 8, D = 64, float32, non-causal)")
    axes.set_ylabel("GFLOP/s")
    axes.set_ylim(bottom=0)
    axes.set_title(f"Attention forward on {model}")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(os.path.join(args.results, "attention_gflops.svg"), metadata={"Date": None})


# --- main ------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-dir", default="build/dev/bench",
                        help="folder with bench_attention and bench_multihead")
    parser.add_argument("--results", default="results", help="output folder")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.peer_worker:  # child process: thread variables are already set
        json.dump(run_peers(args.threads[0], args.lengths), sys.stdout)
        return

    os.makedirs(args.results, exist_ok=True)
    load = os.getloadavg()
    start = cpu_snapshot()
    ours, commands = {}, []
    join = "|".join
    pattern = (f"^(fma_peak/threads:({join(map(str, args.threads))})|(flash|naive|gemm)/"
               f"L:({join(map(str, args.lengths))})/D:{HEAD_DIM}/causal:0/threads:"
               f"({join(map(str, args.threads))}))/")
    data, command = run_benchmark(os.path.join(args.bench_dir, "bench_attention"),
                                  os.path.join(args.results, "bench_attention.json"),
                                  [f"--benchmark_filter={pattern}"])
    commands.append(command)
    for b in data["benchmarks"]:
        fields = dict(re.findall(r"(\w+):(\d+)", b["name"]))
        name = b["name"].split("/")[0]
        length = int(fields["L"]) if "L" in fields else None
        ours[(name, length, int(fields["threads"]))] = b
    for n in args.threads:
        env = dict(os.environ, OMP_NUM_THREADS=str(n))
        data, command = run_benchmark(os.path.join(args.bench_dir, "bench_multihead"),
                                      os.path.join(args.results, f"bench_multihead_t{n}.json"),
                                      [], env)
        commands.append([f"OMP_NUM_THREADS={n}"] + command)
        for b in data["benchmarks"]:
            ours[(b["name"].split("/")[0], None, n)] = b
    middle = cpu_snapshot()

    peers = {}
    for n in args.threads:
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(n), OMP_NUM_THREADS=str(n),
                   MKL_NUM_THREADS=str(n))
        command = [sys.executable, os.path.abspath(__file__), "--peer-worker",
                   "--threads", str(n), "--lengths"] + [str(l) for l in args.lengths]
        print("+ OPENBLAS_NUM_THREADS=%d OMP_NUM_THREADS=%d" % (n, n), " ".join(command),
              flush=True)
        peers[n] = json.loads(subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE,
                                             text=True).stdout)
    others = {"ours": others_cores(start, middle), "peers": others_cores(middle, cpu_snapshot())}
    with open(os.path.join(args.results, "peers.json"), "w") as f:
        json.dump({str(n): p for n, p in peers.items()}, f, indent=1, sort_keys=True)
    write_report(args, ours, peers, commands + [["/usr/bin/python3", "bench/compare.py"]], load,
                 others)
    print(f"compare.py: wrote {args.results}/benchmarks.md, {args.results}/attention_gflops.svg")


if __name__ == "__main__":
    main()
