"""The per-step cost of sending a step to tensor-parallel ranks (what TP adds to a step's CPU
time): the core packs its slot and sends header + 2 frames to every rank; a rank receives,
decodes and unpacks them into its own slot.

    python -m slipstream.bench.tp_send --rows 256 --context 1024 --ranks 2

A decode step of `rows` sequences of `context` tokens; the ranks' sockets live in this
process (ipc://, through the kernel as between processes), so one number covers both ends.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
import zmq

from slipstream.executor.messages import Step, encoder, to_worker
from slipstream.runner.slots import IOSlot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m slipstream.bench.tp_send")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args(argv)
    B, bs = a.rows, a.block_size
    cpu = torch.device("cpu")
    max_blocks = -(-a.max_model_len // bs)
    src = IOSlot(0, 8192, B, max_blocks, cpu, None, host_only=True)
    dst = [IOSlot(0, 8192, B, max_blocks, cpu, None, host_only=True) for _ in range(a.ranks)]
    rng = np.random.default_rng(0)
    src.host_int.numpy()[:] = rng.integers(0, 1 << 20, src.host_int.numel())
    cols = -(-a.context // bs)
    folder = tempfile.mkdtemp(prefix="tp-send-")
    ctx = zmq.Context()
    pushes, pulls = [], []
    for r in range(a.ranks):
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(f"ipc://{folder}/{r}")
        pull.connect(f"ipc://{folder}/{r}")
        pushes.append(push)
        pulls.append(pull)
    send_s = recv_s = 0.0
    for i in range(a.steps + 100):
        t0 = time.perf_counter()
        ints, floats = src.pack(B, B, B, B, cols)
        header = encoder.encode(Step(i, B, B, B, 1, a.context, False, False, 0, True, 0, B, cols, B))
        for s in pushes:
            s.send_multipart([header, ints, floats], copy=False)
        t1 = time.perf_counter()
        for s, slot in zip(pulls, dst):
            frames = s.recv_multipart(copy=False)
            h = to_worker.decode(frames[0].buffer)
            slot.unpack(frames[1].buffer, frames[2].buffer, h.num_tokens, h.num_seqs, h.num_samples,
                        h.num_rows, h.block_cols)
        t2 = time.perf_counter()
        if i >= 100:  # (warm-up)
            send_s, recv_s = send_s + t1 - t0, recv_s + t2 - t1
    assert (dst[-1].host.block_table[:B, :cols] == src.host.block_table[:B, :cols]).all()
    n = a.steps
    print(f"decode step, {B} rows x {a.context} tokens ({cols} block columns), {a.ranks} ranks, "
          f"{ints.nbytes + floats.nbytes} payload bytes: core pack+encode+send {1e6 * send_s / n:.1f} us, "
          f"ranks recv+decode+unpack {1e6 * recv_s / n:.1f} us in all ({1e6 * recv_s / n / a.ranks:.1f} us a rank)")
    ctx.destroy(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
