"""GPT-2 written plainly in PyTorch, in float64, as a reference for the C++
model: reads config.json, <name>.bin (fp32 weights in Hugging Face's layout),
inputs.bin and targets.bin (int32) from the directory given as argv[1];
writes logits.bin, loss.bin and grad/<name>.bin (fp32) there."""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F


def main(d):
    torch.set_num_threads(1)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    V, C, L, H = cfg["vocab"], cfg["embd"], cfg["layer"], cfg["head"]
    B, T = cfg["batch"], cfg["seq"]

    def load(name, dtype=torch.float32):
        with open(os.path.join(d, name), "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=dtype)

    params = {}
    for name, shape in cfg["params"]:
        params[name] = load(name + ".bin").reshape(shape).double().requires_grad_()
    idx = load("inputs.bin", torch.int32).long().reshape(B, T)
    tgt = load("targets.bin", torch.int32).long().reshape(B, T)
    p = params

    def ln(x, pre):
        return F.layer_norm(x, (C,), p[pre + ".weight"], p[pre + ".bias"], 1e-5)

    x = p["wte.weight"][idx] + p["wpe.weight"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        h = "h.%d." % l
        a = ln(x, h + "ln_1") @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"]
        q, k, v = a.split(C, dim=2)
        q, k, v = [t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v)]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"]
        m = ln(x, h + "ln_2") @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"]
        m = F.gelu(m, approximate="tanh")
        x = x + m @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"]
    logits = ln(x, "ln_f") @ p["wte.weight"].t()
    loss = F.cross_entropy(logits.reshape(B * T, V), tgt.reshape(B * T))
    loss.backward()

    def save(name, t):
        t.detach().float().contiguous().numpy().tofile(os.path.join(d, name))

    save("logits.bin", logits)
    save("loss.bin", loss.reshape(1))
    os.makedirs(os.path.join(d, "grad"), exist_ok=True)
    for name, t in params.items():
        save(os.path.join("grad", name + ".bin"), t.grad)


if __name__ == "__main__":
    main(sys.argv[1])
