"""`MultiprocExecutor`: tensor parallelism over worker processes, one per rank.

The core's process holds no model and joins no collective, so a rank that dies or hangs
can never block it: it watches the workers (their exit codes, and a deadline on each
step's tokens) and ends the engine with one line naming the rank, then stops the others.

Per step the core fills one host-only slot from the batch (the same `fill_inputs` and
graph padding as a one-rank runner), packs what the step reads into an int32 and a
float32 array (IOSlot.pack) and sends them, with a small `Step` header, to every rank.
Rank 0 sends the sampled tokens back (every rank sampled the same: same gathered logits,
same seeds). Why all ranks in workers rather than rank 0 in the core: the core's process
may be the user's (LLM), and must not be torn down by an NCCL timeout or stuck in a
collective; and each rank's kernel launches run in parallel with the core's scheduling.
"""
from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
import weakref
from dataclasses import asdict

import numpy as np
import torch
import zmq

from slipstream.utils.process import new_socket
from slipstream.errors import EngineDeadError
from slipstream.executor.messages import (Allocate, Profiled, Step, StepDone, Stop, WorkerFailed,
                                          WorkerReady, encoder, from_worker)
from slipstream.executor.worker import worker_main
from slipstream.model.parallel import COLLECTIVE_TIMEOUT_S
from slipstream.runner.graphs import step_graphs
from slipstream.runner.inputs import fill_inputs
from slipstream.runner.model_runner import Launched, RunnerOptions
from slipstream.runner.prompt_logprobs import step_prompt_spans
from slipstream.runner.slots import IOSlot
from slipstream.sched.batch import BatchResult, ScheduledBatch

POLL_MS = 100  # how often a waiting core looks at the workers' exit codes
STEP_DEADLINE_S = COLLECTIVE_TIMEOUT_S + 30  # a step's tokens later than this: a rank hangs
GRACE_S = 0.5  # after a rank reports an error: time for a dead peer's exit to show


class MultiprocExecutor:
    def __init__(self, size: int, worker_config: dict, opts: RunnerOptions, device: torch.device) -> None:
        self.size = size
        self.block_size, self.max_model_len = opts.block_size, opts.max_model_len
        self.graphs = step_graphs(opts, device)  # the ranks' graph sizes: how a batch is padded
        max_tokens = max(opts.max_num_batched_tokens, opts.max_num_seqs)
        self.slot = IOSlot(0, max_tokens, opts.max_num_seqs, -(-opts.max_model_len // opts.block_size),
                           torch.device("cpu"), None, host_only=True)
        self._dir = tempfile.mkdtemp(prefix="slipstream-tp-")
        self.ctx = zmq.Context()
        self.results = self._bind(zmq.PULL, f"ipc://{self._dir}/results")
        self.step_socks = [self._bind(zmq.PUSH, f"ipc://{self._dir}/step-{r}") for r in range(size)]
        self._results: dict[int, StepDone] = {}
        self._closed = False
        # no rank may outlive the engine (a finalizer, in case nobody calls close)
        self.procs = _start_workers(size, worker_config, asdict(opts), self._dir)
        self._finalizer = weakref.finalize(self, _kill, self.procs, self._dir)
        try:
            counts = [m.num_blocks for m in self._gather(Profiled)]  # setup phase 1 on every rank
            self.num_blocks = min(counts)
            self._send_all(encoder.encode(Allocate(self.num_blocks)))  # phases 2 and 3
            self._gather(WorkerReady)
        except BaseException:
            self.close()
            raise

    def _bind(self, kind: int, addr: str) -> zmq.Socket:
        sock = new_socket(self.ctx, kind)
        sock.bind(addr)
        return sock

    def _send_all(self, *frames) -> None:
        """To every rank. A PUSH socket whose peer is gone would block: never wait blindly."""
        for sock in self.step_socks:
            deadline = time.monotonic() + STEP_DEADLINE_S
            while True:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self._check_alive()
                    if time.monotonic() > deadline:
                        self._fail("a tensor-parallel rank does not take its steps")
                    time.sleep(0.001)

    # -- the runner's face ------------------------------------------------------------
    def launch(self, batch: ScheduledBatch) -> Launched:
        slot = self.slot  # (packed at once: free again when this returns)
        pad = None
        if self.graphs is not None:
            pad = self.graphs.padding(batch.num_tokens, batch.num_seqs, batch.is_decode_only)
        shape = fill_inputs(batch, slot.host, self.block_size, pad, self.max_model_len)
        cols = -(-batch.max_seq_len // self.block_size)
        ints, floats = slot.pack(shape.num_tokens, shape.num_seqs, shape.num_samples, batch.num_seqs, cols)
        spans = [(f, c, t.tolist(), k) for f, c, t, k in step_prompt_spans(batch, slot.host.query_start_loc)]
        f = shape.flags
        header = Step(batch.batch_id, shape.num_tokens, shape.num_seqs, shape.num_samples, shape.max_query_len,
                      shape.max_seq_len, f.use_top_k_top_p, f.use_penalties, f.num_logprobs, shape.padded,
                      shape.num_decode, batch.num_seqs, cols, len(batch.sampled), batch.suppress,
                      batch.penalty_resets, spans)
        self._send_all(encoder.encode(header), ints, floats)
        return Launched(batch, slot, len(batch.sampled), f.num_logprobs)

    def wait(self, launched: Launched) -> BatchResult:
        batch_id = launched.batch.batch_id
        deadline = time.monotonic() + STEP_DEADLINE_S
        while batch_id not in self._results:
            msg = self._receive(deadline)
            if isinstance(msg, StepDone):
                self._results[msg.batch_id] = msg
        return _batch_result(self._results.pop(batch_id))

    # -- watching the workers ---------------------------------------------------------
    def _receive(self, deadline: float | None):
        """The next message of any rank; EngineDeadError when a rank died, failed or hangs."""
        while not self.results.poll(POLL_MS):
            dead = self._dead_rank()
            # a rank that failed (its collective timed out, say) reports why before it exits:
            # read that report if it comes, rather than name the exit alone
            if dead and not self.results.poll(int(GRACE_S * 1000)):
                self._fail(dead)
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"a tensor-parallel rank hangs: no result within {STEP_DEADLINE_S:.0f} s")
        msg = from_worker.decode(self.results.recv())
        if isinstance(msg, WorkerFailed):
            time.sleep(GRACE_S)  # a peer that died makes the others fail too: name the dead one
            dead = self._dead_rank(besides=msg.rank)
            hint = " (a collective timed out: another rank hangs)" if "timed out" in msg.message.lower() else ""
            self._fail(dead or f"tensor-parallel rank {msg.rank} failed: {msg.message}{hint}")
        return msg

    def _gather(self, kind) -> list:
        """One message of `kind` from every rank (setup), by rank."""
        got: dict[int, object] = {}
        while len(got) < self.size:
            msg = self._receive(None)
            if not isinstance(msg, kind):
                self._fail(f"tensor-parallel setup: expected {kind.__name__}, got {type(msg).__name__}")
            got[msg.rank] = msg
        return [got[r] for r in range(self.size)]

    def _dead_rank(self, besides: int | None = None) -> str | None:
        """A rank killed by a signal, else one that exited (other than `besides`, which
        reported its error), described in one line; None when all run."""
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None and p.exitcode < 0:
                return f"tensor-parallel rank {rank} died ({_describe(p.exitcode)})"
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None and rank != besides:
                return f"tensor-parallel rank {rank} exited ({_describe(p.exitcode)})"
        return None

    def _check_alive(self) -> None:
        dead = self._dead_rank()
        if dead:
            self._fail(dead)

    def _fail(self, message: str):
        self.close(graceful=False)
        raise EngineDeadError(message)

    # -- shutdown ---------------------------------------------------------------------
    def close(self, graceful: bool = True) -> None:
        """Stop every worker (asked first when `graceful`, then terminated, then killed)."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for sock in self.step_socks:
                try:
                    sock.send(encoder.encode(Stop()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            deadline = time.monotonic() + 10
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # terminate / kill what is left, remove the socket folder
        for sock in [self.results, *self.step_socks]:
            sock.close(0)
        self.ctx.term()


def _start_workers(size: int, worker_config: dict, opts: dict, folder: str) -> list:
    import os
    mp = torch.multiprocessing.get_context("spawn")
    config_json, opts_json = json.dumps(worker_config), json.dumps(dict(opts, trace=False))
    procs = []
    for rank in range(size):
        p = mp.Process(target=worker_main, name=f"slipstream-tp-rank{rank}", daemon=True,
                       args=(rank, size, config_json, opts_json, f"file://{folder}/rendezvous",
                             f"ipc://{folder}/step-{rank}", f"ipc://{folder}/results", os.getpid()))
        p.start()
        procs.append(p)
    return procs


def _kill(procs: list, folder: str) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    shutil.rmtree(folder, ignore_errors=True)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _batch_result(msg: StepDone) -> BatchResult:
    tokens = np.frombuffer(msg.tokens, np.int32)
    result = BatchResult(tokens=tokens)
    k = msg.num_logprobs
    if msg.logprobs:
        result.logprobs = np.frombuffer(msg.logprobs, np.float32).reshape(len(tokens), -1)
        result.logprob_ids = np.frombuffer(msg.logprob_ids, np.int32).reshape(len(tokens), k)
    if msg.prompt_logprobs:
        result.prompt_logprobs = [(np.frombuffer(lp, np.float32).reshape(m, -1),
                                   np.frombuffer(ids, np.int32).reshape(m, -1)) for lp, ids, m in msg.prompt_logprobs]
    return result
