#!/usr/bin/env python3
"""The framework a user would otherwise pick: the same GPT-2 style model as
strata-finetune's CPU default, trained by a plain PyTorch loop that keeps
everything in RAM (AdamW, fp32: the precision torch's CPU path supports best).
Prints one JSON object with its tokens/s and the configuration it ran with.

  python3 torch_gpt.py [--layers 4] [--embd 256] [--heads 4] [--vocab 256]
                       [--seq-len 128] [--batch 8] [--steps 30] [--threads 0]
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)),
                                        approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, c):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(ctx, c)
        self.h = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]),
                               targets.reshape(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    model = Gpt(a.vocab, a.seq_len, a.layers, a.heads, a.embd)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    times = []
    for _ in range(a.steps):
        idx = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1))
        t0 = time.perf_counter()
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    timed = times[1:] if len(times) > 1 else times
    tokens = a.batch * a.seq_len
    print(json.dumps({
        "tool": "torch_gpt",
        "config": vars(a) | {"torch": torch.__version__, "dtype": "fp32",
                             "optimizer": "AdamW",
                             "threads_used": torch.get_num_threads()},
        "params": sum(x.numel() for x in model.parameters()),
        "tokens_per_s": tokens * len(timed) / sum(timed),
    }))


if __name__ == "__main__":
    main()
