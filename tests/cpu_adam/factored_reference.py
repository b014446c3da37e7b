#!/usr/bin/env python3
"""An independent NumPy reference of Adafactor and SM3 for factored_reference_test.

usage: factored_reference.py DIR ALGO ROWS COLS STEPS [KEY=VALUE ...]
ROWS = 0: a vector of COLS elements. Reads DIR/init.f32 (N float32) and
DIR/grads.f32 (STEPS x N float32); writes DIR/param.f32, DIR/stats.f32 (the
row statistics, then the column ones; a vector: one row value, then one per
element) and DIR/exp_avg.f32 (zeros when there is no first moment).

Adafactor follows Shazeer & Stern (2018) as HF transformers' Adafactor
implements it: factored second moment from row and column means of
g^2 + eps1, beta2_t = 1 - t^decay_rate, the update divided by
max(1, RMS(update) / d), relative step min(1e-2, 1/sqrt(t)) scaled by
max(eps2, RMS(param)), optional first moment over the scaled update,
decoupled weight decay p -= wd * lr * p. SM3 is SM3-II (Anil et al. 2019)
with the rows and columns as cover sets: nu = min(row acc, col acc) + g^2,
the accumulators become the row and column maxima of nu, the update
g / (sqrt(nu) + eps), optional momentum m = b m + (1 - b) u, L2 decay.
Element-wise arithmetic is float32, reductions float64.
"""
import os
import sys

import numpy as np

F = np.float32


def adafactor(p, grads, rows, cols, steps, kw):
    eps1, eps2 = float(kw.get("eps1", 1e-30)), float(kw.get("eps2", 1e-3))
    d = float(kw.get("clip_threshold", 1.0))
    decay = float(kw.get("decay_rate", -0.8))
    beta1 = float(kw.get("beta1", 0.0))
    wd = float(kw.get("weight_decay", 0.0))
    relative = kw.get("relative_step", "1") == "1"
    scale_p = kw.get("scale_parameter", "1") == "1"
    lr_fixed = float(kw.get("lr", 1e-2))
    r = rows if rows else 1
    c = cols
    p = p.reshape(r, c)
    row = np.zeros(r, F)
    col = np.zeros(c, F)
    m = np.zeros((r, c), F)
    for t in range(1, steps + 1):
        g = grads[t - 1].reshape(r, c)
        rms_p = np.sqrt(np.mean(p.astype(np.float64) ** 2))
        lr = min(1e-2, 1.0 / np.sqrt(t)) if relative else lr_fixed
        if scale_p:
            lr *= max(eps2, rms_p)
        b2 = 1.0 - t ** decay
        sq = g * g + F(eps1)
        row = row * F(b2) + F(1.0 - b2) * sq.astype(np.float64).mean(1).astype(F)
        col = col * F(b2) + F(1.0 - b2) * sq.astype(np.float64).mean(0).astype(F)
        if rows:
            rf = F(1.0) / np.sqrt(row / F(row.astype(np.float64).mean()))
            cf = F(1.0) / np.sqrt(col)
            u = (rf[:, None] * cf[None, :]) * g
        else:  # unfactored: v is the column statistic of one row
            u = (F(1.0) / np.sqrt(col))[None, :] * g
        rms_u = np.sqrt(np.mean(u.astype(np.float64) ** 2))
        u = (u / F(max(1.0, rms_u / d))) * F(lr)
        if beta1 > 0:
            m = m * F(beta1) + F(1.0 - beta1) * u
            u = m
        if wd:
            p = p + p * F(-wd * lr)
        p = p - u
    return p, np.concatenate([row, col]), m


def sm3(p, grads, rows, cols, steps, kw):
    lr = float(kw.get("lr", 0.1))
    mom = float(kw.get("momentum", 0.0))
    eps = float(kw.get("eps", 1e-8))
    wd = float(kw.get("weight_decay", 0.0))
    r = rows if rows else 1
    c = cols
    p = p.reshape(r, c)
    row = np.zeros(r, F)
    col = np.zeros(c, F)
    m = np.zeros((r, c), F)
    for t in range(steps):
        g = grads[t].reshape(r, c)
        if wd:
            g = g + F(wd) * p
        if rows:
            nu = np.minimum(row[:, None], col[None, :]) + g * g
        else:  # a vector: one cover set per element
            nu = col[None, :] + g * g
        row = nu.max(1)
        col = nu.max(0)
        u = g / (np.sqrt(nu) + F(eps))
        if mom > 0:
            m = m * F(mom) + F(1.0 - mom) * u
            u = m
        p = p - F(lr) * u
    return p, np.concatenate([row, col]), m


def main():
    d, algo, rows, cols, steps = sys.argv[1:6]
    rows, cols, steps = int(rows), int(cols), int(steps)
    kw = dict(a.split("=", 1) for a in sys.argv[6:])
    n = (rows if rows else 1) * cols
    p = np.fromfile(os.path.join(d, "init.f32"), dtype=F)
    grads = np.fromfile(os.path.join(d, "grads.f32"), dtype=F).reshape(steps, n)
    fn = {"adafactor": adafactor, "sm3": sm3}[algo]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        p, stats, m = fn(p, grads, rows, cols, steps, kw)
    p.astype(F).tofile(os.path.join(d, "param.f32"))
    stats.astype(F).tofile(os.path.join(d, "stats.f32"))
    m.astype(F).tofile(os.path.join(d, "exp_avg.f32"))


if __name__ == "__main__":
    main()
