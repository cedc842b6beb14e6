"""A tensor-parallel worker: one process per rank, a ModelRunner on its own device.

Started by `MultiprocExecutor` (torch.multiprocessing, spawn) with plain strings and ints
only. It joins the torch.distributed group, loads its shard of the weights, then runs the
runner's setup in three phases with the core in between (its KV block count -> the core
answers with the smallest over the ranks -> allocate and capture), and serves steps: each
`Step` is unpacked into the runner's slot and issued exactly as a one-rank launch; the
asynchronous pipeline is the runner's own. Rank 0 also sends each step's tokens back, from
a thread that waits on the download (so the next step is issued meanwhile).

Any error is sent as one line (`WorkerFailed`) before the process exits; a worker whose
parent is gone exits too.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
import zmq

from slipstream.utils.process import collector_paused
from slipstream.utils.process import new_socket
from slipstream.executor.messages import (Allocate, Profiled, Step, StepDone, Stop, WorkerFailed,
                                          WorkerReady, encoder, to_worker)

POLL_MS = 1000  # an idle worker looks this often whether its parent is alive


def worker_main(rank: int, size: int, config_json: str, opts_json: str, init_method: str,
                step_addr: str, result_addr: str, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    config, opts = json.loads(config_json), json.loads(opts_json)
    cuda = config["device"] == "cuda"
    if cuda:
        from slipstream.model.parallel import NCCL_ENV
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
    ctx = zmq.Context()
    steps = _socket(ctx, zmq.PULL, step_addr)
    out = _socket(ctx, zmq.PUSH, result_addr)
    code = 0
    try:
        with collector_paused():  # (as the engine core's own build)
            runner = _build(rank, size, config, opts, init_method,
                            torch.device("cuda", rank) if cuda else torch.device("cpu"))
            blocks = runner.kv_blocks_that_fit()
        out.send(encoder.encode(Profiled(rank, blocks)))
        msg = _next(steps, parent_pid)
        if isinstance(msg, Allocate):
            with collector_paused():
                runner.allocate(msg.num_blocks)
                runner.capture()
            runner.model.tp.serving()
            out.send(encoder.encode(WorkerReady(rank)))
            _serve(runner, rank, steps, ctx, result_addr, parent_pid)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the core hears it in one line
        traceback.print_exc(file=sys.stderr)
        out.send(encoder.encode(WorkerFailed(rank, _one_line(e))))
        code = 1
    out.close(2000)
    steps.close(0)
    _deliver_queued(ctx)
    os._exit(code)  # (no interpreter teardown: a peer may still hold the collectives)


def _deliver_queued(ctx: zmq.Context, seconds: float = 2.5) -> None:
    """Wait (bounded) until the closed sockets' queued messages are sent: a socket's linger
    acts only while its context terminates, and os._exit would drop them (a rank's
    WorkerFailed report arrived after its exit code, or not at all). The wait is bounded
    because a context with a socket still open never terminates."""
    t = threading.Thread(target=ctx.term, name="slipstream-tp-flush", daemon=True)
    t.start()
    t.join(seconds)


def _socket(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = new_socket(ctx, kind)
    sock.connect(addr)
    return sock


def _build(rank, size, config: dict, opts: dict, init_method: str, device: torch.device):
    from slipstream.model.kv_scales import load_kv_scales
    from slipstream.model.loader import load_config, load_model
    from slipstream.model.parallel import TPShard, init_tp_group
    from slipstream.runner.model_runner import ModelRunner, RunnerOptions
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model_config = load_config(config["model_source"])
    tp = init_tp_group(TPShard(rank, size, model_config), init_method, device)
    try:
        model, model_config = load_model(config["model_source"], config["load_format"], config["dtype"],
                                         device, tp=tp, quantization=config.get("quantization"))
    except torch.OutOfMemoryError as e:
        raise RuntimeError(f"the model does not fit: its rank-{rank} shard alone exhausts {device} "
                           f"memory ({e}); use more ranks, a smaller model or dtype") from None
    model.set_batch_invariant(config["batch_invariant"])
    load_kv_scales(model, config["model_source"], config.get("kv_cache_dtype", "auto"),
                   config["load_format"])
    dtype = next(model.parameters()).dtype
    return ModelRunner(model, model_config, RunnerOptions(**opts), device, dtype, setup=False)


def _next(sock: zmq.Socket, parent_pid: int):
    """The next control message (frames of a step), or None when the parent is gone."""
    while not sock.poll(POLL_MS):
        if os.getppid() != parent_pid:
            return None
    frames = sock.recv_multipart(copy=False)
    msg = to_worker.decode(frames[0].buffer)
    return (msg, frames[1].buffer, frames[2].buffer) if isinstance(msg, Step) else msg


def _serve(runner, rank: int, steps: zmq.Socket, ctx: zmq.Context, result_addr: str, parent_pid: int) -> None:
    waiter = _Waiter(runner, ctx, result_addr, rank) if rank == 0 else None
    try:
        while True:
            msg = _next(steps, parent_pid)
            if msg is None or isinstance(msg, Stop):
                return
            if not isinstance(msg, tuple):
                raise RuntimeError(f"unexpected message {type(msg).__name__} while serving steps")
            launched = issue_step(runner, *msg)
            if waiter is not None:
                waiter.queue.put((msg[0].batch_id, launched))
    finally:
        if waiter is not None:
            waiter.stop()


def issue_step(runner, h: Step, ints, floats):
    """A received step on this rank: its inputs into the runner's slot, then the device work."""
    from slipstream.runner.inputs import StepShape
    from slipstream.sampling.sampler import SamplerFlags
    slot = runner.slots[h.batch_id % 2]
    slot.h2d_done.synchronize()  # the slot's last upload is done: its host side is free
    slot.unpack(ints, floats, h.num_tokens, h.num_seqs, h.num_samples, h.num_rows, h.block_cols)
    shape = StepShape(h.num_tokens, h.num_seqs, h.num_samples, h.max_query_len, h.max_seq_len,
                      SamplerFlags(h.use_top_k_top_p, h.use_penalties, h.num_logprobs), h.padded,
                      num_decode=h.num_decode)
    spans = [(f, c, np.asarray(t, np.int64), k) for f, c, t, k in h.prompt_spans] or None
    return runner.issue(None, slot, shape, h.num_rows, h.suppress, h.penalty_resets, spans, h.num_results)


class _Waiter:
    """Rank 0's thread: waits for each launched step's download, sends its tokens."""

    def __init__(self, runner, ctx: zmq.Context, result_addr: str, rank: int) -> None:
        self.runner, self.rank = runner, rank
        self.sock = _socket(ctx, zmq.PUSH, result_addr)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="slipstream-tp-waiter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.runner.device.type == "cuda":
                torch.cuda.set_device(self.runner.device)  # (the current device is per thread)
            while (item := self.queue.get()) is not None:
                batch_id, launched = item
                self.sock.send(encoder.encode(done_message(batch_id, self.runner.wait(launched))))
        except BaseException as e:  # noqa: BLE001 - the process cannot go on: say so and end it
            traceback.print_exc(file=sys.stderr)
            # (the main thread's sockets stay open, so the context cannot terminate here:
            # wait until zmq has taken the report, then give it a moment to be written)
            tracker = self.sock.send(encoder.encode(WorkerFailed(self.rank, _one_line(e))), copy=False,
                                     track=True)
            tracker.wait(2)
            self.sock.close(2000)
            time.sleep(0.2)
            os._exit(1)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(2)
        self.sock.close(2000)


def done_message(batch_id: int, result) -> StepDone:
    msg = StepDone(batch_id, result.tokens.tobytes())
    if result.logprobs is not None:
        msg.num_logprobs = result.logprob_ids.shape[1]
        msg.logprobs, msg.logprob_ids = result.logprobs.tobytes(), result.logprob_ids.tobytes()
    if result.prompt_logprobs:
        msg.prompt_logprobs = [(lp.astype(np.float32).tobytes(), ids.astype(np.int32).tobytes(), len(lp))
                               for lp, ids in result.prompt_logprobs]
    return msg


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:2000]
