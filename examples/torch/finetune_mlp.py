#!/usr/bin/env python3
"""Fine-tunes a small torch MLP with strata.torch.offload: its parameters and
AdamW states rest on NVMe (a scratch directory), a device budget below the
model's size holds what each layer needs, and strata's CPU optimizer steps.
Then the same model trains in plain torch (bf16 compute, fp32 AdamW master)
for comparison, and both step times are printed.

    PYTHONPATH=build/python python3 examples/torch/finetune_mlp.py
    ... --nvme /mnt/nvme/scratch --steps 50 --hidden 2048 --device cuda

Without a GPU the engine runs on the host-emulated device and the model on
CPU tensors. docs/python.md explains what offload does.
"""

import argparse
import copy
import json
import tempfile
import time

import torch

import strata.torch


def make_model(hidden, layers, seed=0):
    torch.manual_seed(seed)
    mods = [torch.nn.Linear(128, hidden), torch.nn.GELU()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    mods.append(torch.nn.Linear(hidden, 16))
    return torch.nn.Sequential(*mods)


def make_data(steps, batch, device):
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(128, 16, generator=gen) / 128 ** 0.5
    data = []
    for _ in range(steps):
        x = torch.randn(batch, 128, generator=gen)
        data.append((x.to(device), torch.tanh(x @ teacher).to(device)))
    return data


def run_offloaded(model, data, args, device):
    nbytes = sum(p.numel() for p in model.parameters()) * 2  # bf16
    largest = max(p.numel() for p in model.parameters()) * 2
    # Half the model, and room for the largest layer and a prefetch.
    budget = max(largest + (2 << 20), nbytes // 2)
    budget = (budget + 4095) // 4096 * 4096
    config = {
        "strata": {
            "params": "nvme",
            "optimizer_states": "nvme",
            "nvme_paths": [args.nvme],
            "device_budget_bytes": budget,
            "partition_bytes": 1 << 20,
            "persistence_threshold_bytes": 0,
            "io": {"backend": "psync", "direct_io": args.direct_io},
            "optimizer": {"weight_decay": 0.01},
        }
    }
    print("model %.1f MiB in bf16, device budget %.1f MiB"
          % (nbytes / 2**20, budget / 2**20))
    losses, times = [], []
    with strata.torch.offload(model, config, device=device) as off:
        for x, y in data:
            t0 = time.perf_counter()
            # The model computes in bf16; the loss in fp32 (torch 1.13 has
            # no bf16 mse_loss on CPU).
            # No clipping: the engine may take each layer's gradient
            # statistics while backward still runs (begin_step), so that
            # the step reads each gradient once.
            if args.begin_step == "on":
                off.begin_step(lr=args.lr)
            loss = torch.nn.functional.mse_loss(off(x.bfloat16()).float(), y)
            loss.backward()
            off.step(lr=args.lr)
            off.zero_grad()
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        stats = off.stats()
    return losses, times, stats


def run_plain(model, data, args):
    work = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses, times = [], []
    for x, y in data:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(work(x.bfloat16()).float(), y)
        loss.backward()
        for pm, pw in zip(model.parameters(), work.parameters()):
            pm.grad = pw.grad.float()
            pw.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in zip(model.parameters(), work.parameters()):
                pw.copy_(pm)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--nvme", default=None,
                    help="scratch directory for the NVMe tier "
                         "(default: a temporary directory)")
    ap.add_argument("--direct-io", action="store_true",
                    help="O_DIRECT (not on tmpfs)")
    ap.add_argument("--device", choices=["host", "cuda"], default=None,
                    help="default: cuda when torch sees a GPU")
    ap.add_argument("--begin-step", choices=["on", "off"], default="on",
                    help="announce each step before its backward (default "
                         "on)")
    ap.add_argument("--json", action="store_true",
                    help="print the figures as one JSON object")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "host")
    tdev = "cuda" if device == "cuda" else "cpu"
    data = make_data(args.steps, args.batch, tdev)

    with tempfile.TemporaryDirectory(prefix="strata-example-") as tmp:
        if args.nvme is None:
            args.nvme = tmp
        base = make_model(args.hidden, args.layers)
        off_losses, off_times, stats = run_offloaded(
            copy.deepcopy(base), data, args, device)
    plain_losses, plain_times = run_plain(base.to(tdev), data, args)

    # The first step records the fetch order and warms the caches.
    off_step, plain_step = median(off_times[1:]), median(plain_times[1:])
    result = {
        "device": device,
        "params": sum(p.numel() for p in base.parameters()),
        "steps": args.steps,
        "batch": args.batch,
        "hidden": args.hidden,
        "layers": args.layers,
        "lr": args.lr,
        "begin_step": args.begin_step,
        "loss_first": off_losses[0],
        "loss_last_offloaded": off_losses[-1],
        "loss_last_plain": plain_losses[-1],
        "step_s_offloaded": off_step,
        "step_s_plain": plain_step,
        "engine_step_s": stats["step_seconds"],
        "fetch_stall_s_total": stats["stall_seconds"],
        "nvme_read_MiB": stats["nvme_read_bytes"] / 2**20,
        "nvme_write_MiB": stats["nvme_write_bytes"] / 2**20,
        "fetches": stats["fetches"],
        "prefetch_hits": stats["prefetch_hits"],
        "early_statistics": stats["early_statistics"],
    }
    if args.json:
        print(json.dumps(result))
        return
    for i in range(0, args.steps, max(1, args.steps // 5)):
        print("step %3d  loss offloaded %.5f  plain %.5f"
              % (i, off_losses[i], plain_losses[i]))
    print("median step: offloaded %.1f ms, plain torch %.1f ms "
          "(engine's optimizer step %.1f ms; fetch stalls %.1f ms in all)"
          % (off_step * 1e3, plain_step * 1e3, stats["step_seconds"] * 1e3,
             stats["stall_seconds"] * 1e3))


if __name__ == "__main__":
    main()
