"""One rank of test_engine_mpi's offload case: strata.torch.offload of the
same MLP on every rank over a strata.Communicator('mpi') with zero_stage
argv[2] (optimizer states, and with stage 3 the parameters, on NVMe, a
temporary directory per rank), each rank training on its own half of every batch: SAVED_AT steps, a
checkpoint into argv[1]/ckpt, 2 more steps. Writes its masters at the save
and at the end into argv[1]/rank-R-{saved,final}.pt and prints
"rank R: ok"."""

import os
import sys
import tempfile

import torch

import strata
import strata.torch as storch
from test_offload import KIB, batches, engine_config, make_mlp

SAVED_AT = 3
STEPS = SAVED_AT + 2
LR = 2e-3


def halves(rank, size):
    """Rank `rank`'s rows of each batch of test_offload.batches."""
    out = []
    for x, y in batches(STEPS):
        n = x.shape[0] // size
        out.append((x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
    return out


def params(stage):
    """Stage 3 keeps the parameters on NVMe; below it, on the device."""
    return {} if stage == 3 else {"params": "device"}


def train(off, data):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(off(x.bfloat16()).float(), y)
        loss.backward()
        if not off.step(lr=LR).applied:
            raise AssertionError("a step was skipped")


def main():
    out, stage = sys.argv[1], int(sys.argv[2])
    comm = strata.Communicator("mpi", timeout_s=120)
    rank, size = comm.rank, comm.size
    data = halves(rank, size)
    with tempfile.TemporaryDirectory(prefix="strata-mpi-offload-") as nvme:
        cfg = engine_config(nvme, 768 * KIB, world_size=size, rank=rank,
                            zero_stage=stage, **params(stage))
        with storch.offload(make_mlp(0), cfg, device="host",
                            comm=comm) as off:
            train(off, data[:SAVED_AT])
            saved = off.state_dict()
            off.save_checkpoint(os.path.join(out, "ckpt"), SAVED_AT)
            train(off, data[SAVED_AT:])
            final = off.state_dict()
    torch.save(saved, os.path.join(out, "rank-%d-saved.pt" % rank))
    torch.save(final, os.path.join(out, "rank-%d-final.pt" % rank))
    print("rank %d: ok" % rank, flush=True)


if __name__ == "__main__":
    main()
