"""`slipstream serve` and `slipstream run-batch`: parsers and entry points.

slipstream/cli/main.py adds them with::

    from slipstream.cli.serve import add_run_batch_parser, add_serve_parser
    add_serve_parser(sub, engine_args)
    add_run_batch_parser(sub, engine_args)

and each sub-command's `func(args)` returns the exit code.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import json
import math
import os
import time

from slipstream.server import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("slipstream.server")


def _server_args(p: argparse.ArgumentParser) -> None:
    from slipstream.cli.options import chat_args
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send (default: the model's own name); the "
                        "first is reported in responses")
    chat_args(p, "--default-chat-template-kwargs")
    from slipstream.server.reasoning_parsers import REASONING_PARSERS
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's replies: the thinking goes to "
                        "reasoning_content (and reasoning), the answer to content")
    from slipstream.server.tool_parsers import TOOL_PARSERS
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the markup the model writes tool calls in (hermes: Qwen2.5/Qwen3, "
                        "llama3_json: Llama 3.1/3.2, mistral); chat replies' calls become "
                        "message.tool_calls, and tool_choice \"required\" or a named tool is "
                        "forced in that markup")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice \"auto\" (the default with tools): the model may "
                        "call a tool or answer; needs --tool-call-parser")


def add_serve_parser(subparsers, engine_args_fn):
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed when ready)")
    _server_args(p)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the environment's "
                        f"{' or '.join(API_KEY_ENV)}, which keeps the key out of process lists)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="answer 503 (with Retry-After) when more than N requests would wait "
                        "for a running slot (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let running requests finish before "
                        "aborting them")
    p.add_argument("--max-core-restarts", type=int, default=3,
                   help="start an engine core that died again, at most N times (its requests end "
                        "with an error; /health answers 503 until it is back); once they are spent "
                        "the server exits with code 1. 0: exit at the first death. (One engine; "
                        "--data-parallel-size replicas restart as before)")
    p.add_argument("--core-restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart; each next one waits twice as long (at most 30)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send one streamed chunk per K tokens (always at the end)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body (413 above)")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="stored /v1/responses kept in memory for previous_response_id "
                        "(the least recently used go first; 0: none kept)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind this endpoint (each its own core process; "
                        "sharing one GPU: give each --gpu-memory-utilization <= 1/N)")
    p.add_argument("--ray-address", default=None,
                   help="run the replicas as Ray actors on this cluster ('auto': the one this "
                        "machine is in), one GPU each on CUDA; needs slipstream[ray]")
    engine_args_fn(p)
    p.set_defaults(func=cmd_serve)
    return p


def add_run_batch_parser(subparsers, engine_args_fn):
    p = subparsers.add_parser("run-batch", help="run an OpenAI Batch API file (JSONL) offline")
    p.add_argument("-i", "--input-file", required=True, help="JSONL requests ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, help="JSONL results ('-': stdout)")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="requests in flight at once")
    _server_args(p)
    engine_args_fn(p)
    p.set_defaults(func=cmd_run_batch)
    return p


def _check_flags(a: argparse.Namespace) -> None:
    from slipstream.cli.options import chat_defaults
    a.chat_defaults = chat_defaults(a)  # the chat template flags, read (ValueError if bad)
    for name in ("max_waiting", "stream_interval", "max_body_bytes", "max_concurrency",
                 "data_parallel_size", "responses_store_size", "max_core_restarts"):
        v = getattr(a, name, None)
        least = 0 if name in ("max_waiting", "responses_store_size", "max_core_restarts") else 1
        if v is not None and v < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {v}")
    for name in ("shutdown_timeout", "core_restart_backoff"):
        v = getattr(a, name, 0)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
    port = getattr(a, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    if hasattr(a, "api_key"):
        a.api_key = resolve_api_key(a.api_key, os.environ)


#: environment variables that give the API key when --api-key is not given, in order
API_KEY_ENV = ("SLIPSTREAM_API_KEY", "VLLM_API_KEY")


def resolve_api_key(flag: str | None, environ) -> str | None:
    """The API key: --api-key, else the first of API_KEY_ENV set; None: no authentication.
    A key that is empty or only whitespace is refused (it would turn authentication off, or
    match nothing a client can send)."""
    source, key = "--api-key", flag
    if key is None:
        source, key = next(((name, environ[name]) for name in API_KEY_ENV if name in environ),
                           (None, None))
    if key is not None and (not key.strip() or key != key.strip()):
        raise ValueError(f"{source} is empty or has spaces around it: give the key itself "
                         "(leave it out for no authentication)")
    return key


def make_llm(a: argparse.Namespace):
    from slipstream.frontend.async_llm import AsyncLLM
    from slipstream.cli.options import engine_kwargs
    from slipstream.utils.process import freeze_gc
    size, address = getattr(a, "data_parallel_size", 1), getattr(a, "ray_address", None)
    if size > 1 or address:
        llm = make_data_parallel(engine_kwargs(a), size, address)
    else:
        llm = AsyncLLM(core="process", max_core_restarts=getattr(a, "max_core_restarts", 0),
                       core_restart_backoff_s=getattr(a, "core_restart_backoff", 1.0), **engine_kwargs(a))
    freeze_gc()  # a long-lived process: its startup heap need not be scanned again
    return llm


def cmd_serve(a: argparse.Namespace) -> int:
    _check_flags(a)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_serve(a))
    except KeyboardInterrupt:  # Ctrl-C while the model loads (the core is stopped already)
        print("slipstream serve: interrupted while starting", file=sys.stderr)
        return 130


async def watch_core(llm, server, poll_s: float = 0.2) -> None:
    """Stop the server once its engine core is dead for good (its restarts spent), so that
    a supervisor (systemd, Kubernetes) sees the exit and starts it again."""
    while not server.should_exit:
        if getattr(llm, "failed_for_good", False):
            print(f"error: the engine core is dead and will not be restarted: {llm.dead_error}",
                  file=sys.stderr, flush=True)
            server.core_failed = True
            server.should_exit = True
            return
        await asyncio.sleep(poll_s)


async def _serve(a: argparse.Namespace) -> int:
    import uvicorn

    from slipstream.server.app import build_app

    try:
        llm = make_llm(a)
    except (ValueError, RuntimeError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        await llm.stats()  # the engine answers, and its reader runs (so /health sees a death)
        app = build_app(llm, a)
        config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                                lifespan="off", access_log=a.log_level in ("info", "debug"),
                                timeout_graceful_shutdown=5)
        server = _Server(config, app.state.serving, a.shutdown_timeout)
        watcher = asyncio.ensure_future(watch_core(llm, server))
        try:
            await server.serve()
        finally:
            watcher.cancel()
            app.state.serving.close()
        if not server.started:
            print(f"error: could not listen on {a.host}:{a.port}", file=sys.stderr)
            return 1
    finally:
        await llm.shutdown()
    print("slipstream serve: stopped", flush=True)
    return 1 if server.core_failed else 0


class _Server:
    """uvicorn's Server with our signal handling: the first SIGTERM/SIGINT starts the drain
    (503 for new requests, running ones get --shutdown-timeout to finish, the rest are
    aborted), then uvicorn exits; a second signal aborts everything at once."""

    def __new__(cls, config, state, timeout):
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self):
                super().__init__(config)
                self.state, self.timeout = state, timeout
                self.drain_task = None
                self.hurry = asyncio.Event()
                self.core_failed = False  # stopped because the engine core is dead for good

            @contextlib.contextmanager
            def capture_signals(self):
                loop = asyncio.get_running_loop()
                sigs = (signal.SIGINT, signal.SIGTERM)
                for sig in sigs:
                    loop.add_signal_handler(sig, self.on_signal)
                try:
                    yield
                finally:
                    for sig in sigs:
                        loop.remove_signal_handler(sig)

            def on_signal(self):
                if self.drain_task is None:
                    self.drain_task = asyncio.ensure_future(self.drain())
                else:
                    self.hurry.set()

            async def drain(self):
                print("slipstream serve: shutting down", flush=True)
                await drain(self.state, self.timeout, self.hurry)
                self.should_exit = True

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started and not self.should_exit:
                    port = config.port
                    for srv in self.servers:
                        for sock in srv.sockets:
                            port = sock.getsockname()[1]
                    print(f"slipstream serve: ready on http://{config.host}:{port}", flush=True)

        return Server()


async def drain(state, timeout: float, hurry: asyncio.Event | None = None) -> None:
    """Refuse new requests (503), give those being answered `timeout` seconds (or until
    `hurry` is set), abort the engine requests left, and give their answers 2 s to go out."""
    state.shutting_down = True
    deadline = time.monotonic() + timeout
    while state.http_active > 0 and time.monotonic() < deadline:
        if hurry is not None and hurry.is_set():
            break
        await asyncio.sleep(0.05)
    for t in list(state.tasks):
        t.cancel()
    for run in list(state.runs):
        run.cancel()
    deadline = time.monotonic() + 2.0
    while state.http_active > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def cmd_run_batch(a: argparse.Namespace) -> int:
    _check_flags(a)
    return asyncio.run(run_batch_file(a))


def make_data_parallel(engine_options: dict, size: int, ray_address: str | None = None) -> "DataParallelLLM":  # noqa: F821 (imported inside)
    """`size` replicas: local core processes, or Ray actors on the cluster at `ray_address`."""
    from slipstream.frontend.data_parallel import DataParallelLLM, local_replica_factory
    options = dict(engine_options)
    model = options.pop("model", None)
    if ray_address:
        from slipstream.ray.serving import ray_replica_factory
        return DataParallelLLM(ray_replica_factory(model, options, ray_address), size)
    return DataParallelLLM(local_replica_factory(model, options, size), size)


async def run_batch_file(a) -> int:
    from slipstream.server.run_batch import run_batch
    from slipstream.server.serving_common import ServingState

    src = sys.stdin if a.input_file == "-" else open(a.input_file, encoding="utf-8",
                                                      errors="replace")
    with src:
        lines = src.read().splitlines()
    try:
        llm = make_llm(a)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dst = sys.stdout if a.output_file == "-" else open(a.output_file, "w", encoding="utf-8")
    state = None
    try:
        from slipstream.server.reasoning_parsers import get_reasoning_parser
        names = a.served_model_name or [llm.model_name]
        state = ServingState(llm=llm, served_names=list(names), chat_defaults=a.chat_defaults,
                             tool_call_parser=getattr(a, "tool_call_parser", None),
                             enable_auto_tool_choice=getattr(a, "enable_auto_tool_choice", False),
                             reasoning_parser=get_reasoning_parser(getattr(a, "reasoning_parser", None)))

        def write(row: dict) -> None:
            dst.write(json.dumps(row, ensure_ascii=False) + "\n")
            dst.flush()

        done, failed = await run_batch(state, lines, write, a.max_concurrency)
    finally:
        if state is not None:
            state.close()
        await llm.shutdown()
        if dst is not sys.stdout:
            dst.close()
    print(f"run-batch: {done} requests, {failed} failed, written to {a.output_file}",
          file=sys.stderr)
    return 0
