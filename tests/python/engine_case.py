"""A small strata.Engine training run on NumPy arrays, shared by the
single-rank checkpoint tests and the MPI worker: two tensors, bf16 working
copies on the host-emulated device, gradients that differ by rank and whose
mean over the ranks is the same at every world size."""

import json

import numpy as np

import strata

W_SHAPE = (30, 100)
B_SHAPE = (70,)
SHAPES = (W_SHAPE, B_SHAPE)
NAMES = ("w", "b")
LR = 1e-2


def config(world_size=1, rank=0, stage=2, algo="adamw", grads_dir=None):
    """zero_stage `stage`; stage 3 keeps the parameters in host memory (with
    several ranks each rank holds its shard and a fetch gathers them);
    `algo` the CPU optimizer; with `grads_dir` the gradients rest on NVMe
    there."""
    cfg = {"strata": {
        "world_size": world_size,
        "rank": rank,
        "zero_stage": stage,
        "params": "host" if stage == 3 else "device",
        "partition_bytes": 65536,
        "staging_buffer_bytes": 65536,
        "io_block_bytes": 65536,
        "device_budget_bytes": 8 << 20,
        "persistence_threshold_bytes": 0,
        "optimizer": {"threads": 1, "algo": algo},
    }}
    if grads_dir is not None:
        cfg["strata"]["grads"] = "nvme"
        cfg["strata"]["nvme_paths"] = [grads_dir]
    return json.dumps(cfg)


def initial(t):
    n = int(np.prod(SHAPES[t]))
    k = np.arange(n) + t
    return ((k % 11) - 5).astype(np.float32) / 16


def grad(t, step, rank, size):
    """Base(step) + sign * alt, sign summing to 0 over the ranks."""
    n = int(np.prod(SHAPES[t]))
    i = np.arange(n)
    base = (((i + step) % 13) - 6).astype(np.float32) / 64
    alt = ((i % 7) + 1).astype(np.float32) / 8
    sign = np.float32(2 * rank - (size - 1))
    return (base + sign * alt).astype(np.float32).reshape(SHAPES[t])


def make_engine(comm=None, world_size=1, rank=0, stage=2, init=True,
                algo="adamw", grads_dir=None):
    eng = strata.Engine(config(world_size, rank, stage, algo, grads_dir),
                        device="host",
                        device_memory_bytes=64 << 20, comm=comm)
    for name, shape in zip(NAMES, SHAPES):
        eng.register(name, list(shape), dtype="bfloat16")
    eng.start()
    if init:
        for t in range(len(SHAPES)):
            eng.set_initial_values(t, initial(t))
    return eng


def train(eng, first, count, rank=0, size=1, begin_step=False):
    """Steps first .. first+count-1, each rank its own gradients; with
    begin_step, Engine.begin_step before each step's hand-overs."""
    for s in range(first, first + count):
        if begin_step:
            eng.begin_step(lr=LR)
        for t in range(len(SHAPES)):
            eng.add_grad(t, grad(t, s, rank, size))
        r = eng.step(lr=LR)
        if not r.applied:
            raise AssertionError("step %d was skipped" % s)


def masters(eng):
    """Every tensor's fp32 master, concatenated."""
    out = []
    for t, shape in enumerate(SHAPES):
        a = np.empty(int(np.prod(shape)), np.float32)
        eng.read_master(t, a)
        out.append(a)
    return np.concatenate(out)


def to_bf16_bits(a):
    """float32 -> bfloat16 bits, rounded to nearest even (finite values)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def working(eng):
    """Every tensor's working copy (bf16 bits) as fetched: on the
    host-emulated device a pin's memory is host memory."""
    import ctypes
    out = []
    for t in range(len(SHAPES)):
        with eng.fetch(t) as pin:
            pin.wait()
            raw = ctypes.string_at(pin.data_ptr, pin.nbytes)
        out.append(np.frombuffer(raw, np.uint16))
    return np.concatenate(out)
