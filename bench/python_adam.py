#!/usr/bin/env python3
"""Times strata.torch.AdamW.step() against torch.optim.AdamW on CPU tensors.

The same parameters and gradients go through each implementation (strata,
torch's foreach and single-tensor AdamW where that torch has them); each gets
one untimed step (it allocates its moments), then --steps rounds of one timed
step of each in turn. Prints one JSON object: the configuration and, per
implementation, the best and median step time, parameters per second and the
bytes streamed per second (fp32 moments: 16 bytes read, 12 written per
parameter), and each torch implementation's speedup against strata: best
against best, and the median of the rounds' ratios. Other jobs on the
machine show up as spread between best and median; the best step is the
least disturbed one.

With --bench PATH (a strata-bench binary) the same case also runs through
`strata-bench adam` (AdamW, fp32 moments, no working copy, the same
parameters and threads) right before and right after the timed rounds, and the
JSON gives strata's rate as a ratio to the faster of the two: what the
binding costs against the C++ optimizer on one array. The machine's memory
bandwidth can change between runs, so both bench figures are reported.

  PYTHONPATH=build/python python3 bench/python_adam.py --params 256M
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import strata
import strata.torch as storch


def parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def bench_rate(binary, n, threads, variant, steps):
    """params/s of `strata-bench adam` on the case python times, and the
    arguments it ran with (but the JSON file's name)."""
    args = ["adam", "--params", str(n), "--threads", str(threads),
            "--variants", variant, "--optimizer", "adamw", "--moments",
            "fp32", "--working", "none", "--reps", str(steps), "--torch",
            "off"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "adam.json")
        run = subprocess.run([binary] + args + ["--json", out],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["no message"])[-1]
            sys.exit(f"--bench: strata-bench adam exited {run.returncode}: "
                     f"{last}")
        with open(out) as f:
            rows = json.load(f)["results"]
    rates = [r["params_per_s"] for r in rows
             if r.get("optimizer") == "adamw" and r.get("moment_dtype") ==
             "fp32"]
    if not rates:
        sys.exit("--bench: strata-bench adam gave no fp32 AdamW row")
    return max(rates), args


def main():
    # SIGTERM unwinds like Ctrl-C, so a running strata-bench is killed and
    # its temporary directory removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="256M",
                    help="parameters in all (K/M/G suffixes: powers of 2)")
    ap.add_argument("--tensors", type=int, default=64,
                    help="how many tensors the parameters are split into")
    ap.add_argument("--steps", type=int, default=5, help="timed steps each")
    ap.add_argument("--threads", type=int, default=0,
                    help="strata's optimizer threads (0 = all cores)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0 = the CPUs this process "
                    "may use, as strata's threads=0; torch's own default "
                    "can be fewer)")
    ap.add_argument("--moment-dtype", choices=["float32", "bfloat16"],
                    default="float32", help="strata's moment dtype")
    ap.add_argument("--impls", default="strata,torch_foreach,torch_single",
                    help="comma-separated subset of strata, torch_foreach, "
                    "torch_single")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds of pause before each timed step")
    ap.add_argument("--bench", default=None, metavar="PATH",
                    help="a strata-bench binary: also time the same case "
                    "through `strata-bench adam`, before and after strata")
    args = ap.parse_args()
    if not 1 <= args.steps <= 1000:  # strata-bench's --reps takes them too
        ap.error(f"--steps: {args.steps} is out of range; accepted [1, 1000]")
    if not 0 <= args.settle <= 60:
        ap.error(f"--settle: {args.settle} is out of range; accepted [0, 60]")
    if args.bench is not None and not os.access(args.bench, os.X_OK):
        ap.error(f"--bench: {args.bench!r} is not an executable file")

    n = parse_count(args.params)
    if args.tensors < 1 or n < args.tensors:
        ap.error("--tensors must be in [1, --params]")
    torch.set_num_threads(args.torch_threads if args.torch_threads > 0
                          else len(os.sched_getaffinity(0)))
    impls = [s for s in args.impls.split(",") if s]
    known = {"strata", "torch_foreach", "torch_single"}
    if not set(impls) <= known:
        ap.error(f"--impls: unknown {sorted(set(impls) - known)}; "
                 f"accepted {sorted(known)}")
    if args.bench is not None and "strata" not in impls:
        ap.error("--bench: pairs strata's steps with strata-bench; add "
                 "strata to --impls")

    sizes = [n // args.tensors + (i < n % args.tensors)
             for i in range(args.tensors)]
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in sizes:
        p = torch.nn.Parameter(torch.empty(s).uniform_(-1, 1, generator=gen))
        p.grad = torch.empty(s).uniform_(-1e-2, 1e-2, generator=gen)
        params.append(p)

    moment = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        args.moment_dtype]
    makers = {
        "strata": lambda: storch.AdamW(params, lr=args.lr,
                                       weight_decay=args.weight_decay,
                                       moment_dtype=moment,
                                       threads=args.threads),
        "torch_foreach": lambda: torch.optim.AdamW(
            params, lr=args.lr, weight_decay=args.weight_decay, foreach=True),
        "torch_single": lambda: torch.optim.AdamW(
            params, lr=args.lr, weight_decay=args.weight_decay, foreach=False),
    }
    # Every implementation takes one untimed step (it allocates its state),
    # then the timed steps go round by round, one step of each in turn, so
    # that a change of the machine's memory bandwidth during the run (this
    # happens on shared VMs) hits every implementation alike; each round
    # gives one speedup per implementation against strata's step of it.
    opts = {name: makers[name]() for name in impls}
    for opt in opts.values():
        opt.step()
    bench = None
    if "strata" in opts:
        kernel = next(iter(opts["strata"]._kernels.values()))
        variant, strata_threads = kernel.variant, kernel.threads
        if args.bench is not None:
            rate, bench_args = bench_rate(args.bench, n, strata_threads,
                                          variant, args.steps)
            bench = {"args": bench_args, "params_per_s": [rate]}
    times = {name: [] for name in impls}
    for _ in range(args.steps):
        for name, opt in opts.items():
            # What the step before left behind (torch's freed temporaries,
            # its threads winding down) settles first.
            time.sleep(args.settle)
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    if bench is not None:
        rate, _ = bench_rate(args.bench, n, strata_threads, variant,
                             args.steps)
        bench["params_per_s"].append(rate)
    del opts
    results = {}
    for name in impls:
        moment_bytes = 2 if (name == "strata" and moment == torch.bfloat16) \
            else 4
        # read p, g, m, v; write p, m, v
        bytes_per_param = 4 + 4 + 2 * moment_bytes + 4 + 2 * moment_bytes
        best = min(times[name])
        results[name] = {
            "best_s": best,
            "median_s": statistics.median(times[name]),
            "times_s": times[name],
            "params_per_s": n / best,
            "gb_per_s": n * bytes_per_param / best / 1e9,
        }
    if bench is not None:
        # Before and after the timed rounds; the ratio is to the faster.
        bench["strata_ratio"] = (results["strata"]["params_per_s"] /
                                 max(bench["params_per_s"]))
        if args.moment_dtype != "float32":
            bench["note"] = "strata ran bf16 moments; the bench fp32"
        results["strata_bench"] = bench
    for name in impls:
        if name != "strata" and "strata" in results:
            per_round = [t / s for t, s in zip(times[name],
                                               times["strata"])]
            results[name]["strata_speedup_per_round"] = per_round
            results[name]["strata_speedup_median"] = statistics.median(
                per_round)
            results[name]["strata_speedup"] = (results[name]["best_s"] /
                                               results["strata"]["best_s"])

    config = {
        "params": n,
        "tensors": args.tensors,
        "steps": args.steps,
        "settle_s": args.settle,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "strata_moment_dtype": args.moment_dtype,
        "strata_threads": strata_threads if "strata" in results else None,
        "strata_variant": variant if "strata" in results else None,
        "torch_threads": torch.get_num_threads(),
        "strata_version": strata.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    print(json.dumps({"config": config, "results": results}, indent=2))


if __name__ == "__main__":
    main()
