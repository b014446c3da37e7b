#!/usr/bin/env python3
"""Runs torch.optim.Adam or AdamW on tensors given by torch_agreement_test.

usage: torch_trajectory.py DIR ALGO N STEPS LR WD
Reads DIR/init.f32 (N float32) and DIR/grads.f32 (STEPS x N float32), runs
STEPS steps (betas 0.9/0.999, eps 1e-8, amsgrad off, single-tensor path),
writes DIR/param.f32, DIR/exp_avg.f32, DIR/exp_avg_sq.f32.
"""
import os
import sys

import numpy as np
import torch


def main():
    d, algo, n, steps, lr, wd = sys.argv[1:7]
    n, steps, lr, wd = int(n), int(steps), float(lr), float(wd)
    torch.set_num_threads(1)
    init = np.fromfile(os.path.join(d, "init.f32"), dtype=np.float32)
    grads = np.fromfile(os.path.join(d, "grads.f32"), dtype=np.float32)
    grads = grads.reshape(steps, n)
    p = torch.nn.Parameter(torch.from_numpy(init.copy()))
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[algo]
    opt = cls([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd,
              amsgrad=False, foreach=False)
    for s in range(steps):
        p.grad = torch.from_numpy(grads[s].copy())
        opt.step()
    state = opt.state[p]
    p.detach().numpy().tofile(os.path.join(d, "param.f32"))
    state["exp_avg"].numpy().tofile(os.path.join(d, "exp_avg.f32"))
    state["exp_avg_sq"].numpy().tofile(os.path.join(d, "exp_avg_sq.f32"))


if __name__ == "__main__":
    main()
