#!/usr/bin/env python3
"""Times strata.torch.AdamW.step() against torch.optim.AdamW on CPU tensors.

The same parameters and gradients go through each implementation in turn
(strata, then torch's foreach and single-tensor AdamW where that torch has
them); each gets one untimed step (it allocates its moments), then --steps
timed steps. Prints one JSON object: the configuration and, per
implementation, the best and median step time, parameters per second and the
bytes streamed per second (fp32 moments: 16 bytes read, 12 written per
parameter). Other jobs on the machine show up as spread between best and
median; the best step is the least disturbed one.

  PYTHONPATH=build/python python3 bench/python_adam.py --params 256M
"""

import argparse
import json
import os
import platform
import statistics
import sys
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


def time_steps(opt, steps):
    opt.step()  # allocates the moments; untimed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main():
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
    args = ap.parse_args()

    n = parse_count(args.params)
    if args.tensors < 1 or n < args.tensors:
        sys.exit("--tensors must be in [1, --params]")
    torch.set_num_threads(args.torch_threads if args.torch_threads > 0
                          else len(os.sched_getaffinity(0)))
    impls = [s for s in args.impls.split(",") if s]
    known = {"strata", "torch_foreach", "torch_single"}
    if not set(impls) <= known:
        sys.exit(f"--impls: unknown {sorted(set(impls) - known)}; "
                 f"accepted {sorted(known)}")

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
    results = {}
    for name in impls:
        opt = makers[name]()
        times = time_steps(opt, args.steps)
        if name == "strata":
            variant = next(iter(opt._kernels.values())).variant
            strata_threads = next(iter(opt._kernels.values())).threads
        del opt
        moment_bytes = 2 if (name == "strata" and moment == torch.bfloat16) \
            else 4
        # read p, g, m, v; write p, m, v
        bytes_per_param = 4 + 4 + 2 * moment_bytes + 4 + 2 * moment_bytes
        best = min(times)
        results[name] = {
            "best_s": best,
            "median_s": statistics.median(times),
            "times_s": times,
            "params_per_s": n / best,
            "gb_per_s": n * bytes_per_param / best / 1e9,
        }
    for name in impls:
        if name != "strata" and "strata" in results:
            results[name]["strata_speedup"] = (results[name]["best_s"] /
                                               results["strata"]["best_s"])

    config = {
        "params": n,
        "tensors": args.tensors,
        "steps": args.steps,
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
