"""`build_processor`: batch inference over Ray Data on a pool of engine replicas.

Shaped as `ray.data.llm.build_processor(config)`: it returns a callable that maps a
Dataset to a Dataset, lazily (nothing runs until the result is consumed).  The replicas
are a Ray Data actor pool of `EngineReplica`s; an actor that dies is restarted by Ray and
the batches it held run again on the new one, once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from slipstream.config import EngineConfig
from slipstream.ray.cluster import require_ray
from slipstream.frontend.batch_rows import OUTPUT_COLUMNS
from slipstream.ray.rows import check_defaults

__all__ = ["OUTPUT_COLUMNS", "Processor", "build_processor"]


@dataclass(frozen=True)
class Processor:
    model: str | None
    replicas: int
    gpus_per_replica: float
    cpus_per_replica: float
    sampling_params: dict
    batch_size: int
    max_pending_requests: int
    max_concurrent_batches: int
    preserve_order: bool
    core: str
    engine_options: dict = field(default_factory=dict)
    chat_template: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    text_as_chat: bool = False

    def __call__(self, ds):
        """The Dataset of `ds`'s rows with the generation columns added."""
        ray = require_ray()
        # several batches per actor at once: they share its engine
        pool = ray.data.ActorPoolStrategy(size=self.replicas,
                                          max_tasks_in_flight_per_actor=2 * self.max_concurrent_batches,
                                          max_concurrent_calls_per_actor=self.max_concurrent_batches)
        with warnings.catch_warnings():
            # max_task_retries has no named parameter in Ray 2.60 yet; its default (retry
            # for ever) would never end a job whose batch kills every replica it runs on
            warnings.simplefilter("ignore", DeprecationWarning)
            out = ds.map_batches(
                _replica_class(), batch_format="pyarrow", batch_size=self.batch_size, compute=pool,
                zero_copy_batch=True,
                fn_constructor_kwargs=dict(model=self.model, engine_options=self.engine_options,
                                           defaults=self.sampling_params,
                                           max_pending_requests=self.max_pending_requests,
                                           core=self.core, chat_template=self.chat_template,
                                           chat_template_kwargs=self.chat_template_kwargs,
                                           text_as_chat=self.text_as_chat),
                num_gpus=self.gpus_per_replica or None, num_cpus=self.cpus_per_replica,
                # a dead replica is replaced; the batches it held run once more
                max_restarts=-1, max_task_retries=1)
        if self.preserve_order:
            out.context.execution_options.preserve_order = True
        return out


def _replica_class():
    from slipstream.ray.replica import EngineReplica
    return EngineReplica


def build_processor(model: str | None = None, *, replicas: int = 1, gpus_per_replica: float = 0,
                    cpus_per_replica: float = 1, sampling_params: dict | None = None,
                    batch_size: int = 32, max_pending_requests: int | None = None,
                    max_concurrent_batches: int = 4, preserve_order: bool = False,
                    core: str = "process", chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None, text_as_chat: bool = False,
                    **engine_options) -> Processor:
    """A callable mapping a Dataset of rows (`prompt`, `prompt_token_ids` or `messages`,
    optional per-row `sampling_params`: `slipstream.frontend.batch_rows`) to the same rows
    with `OUTPUT_COLUMNS` added.

    replicas: engine actors; gpus_per_replica / cpus_per_replica: what each reserves (0.5
    GPUs: two replicas share a GPU; then give each gpu_memory_utilization <= 0.45);
    max_pending_requests: requests in the engine per replica at once (default batch_size
    x max_concurrent_batches); preserve_order: output rows in input order (slower).
    chat_template / chat_template_kwargs: for `messages` rows, a Jinja template instead of
    the tokenizer's and extra template variables (a row's own `chat_template_kwargs` go
    over these); text_as_chat: a `prompt` text is one user message of a chat.
    engine_options: EngineConfig fields (device, max_model_len, ...). Every argument is
    checked here, before any actor starts."""
    for name, value in (("replicas", replicas), ("batch_size", batch_size),
                        ("max_concurrent_batches", max_concurrent_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_pending_requests is not None and (not isinstance(max_pending_requests, int)
                                             or max_pending_requests < 1):
        raise ValueError(f"max_pending_requests must be a positive integer, got {max_pending_requests!r}")
    for name, value in (("gpus_per_replica", gpus_per_replica), ("cpus_per_replica", cpus_per_replica)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if core not in ("process", "thread"):
        raise ValueError(f"core must be 'process' or 'thread', got {core!r}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be a string, got {type(chat_template).__name__}")
    if not isinstance(text_as_chat, bool):
        raise ValueError(f"text_as_chat must be true or false, got {text_as_chat!r}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a mapping, got {type(chat_template_kwargs).__name__}")
    EngineConfig.from_kwargs(model=model, **engine_options)
    return Processor(model=model, replicas=replicas, gpus_per_replica=gpus_per_replica,
                     cpus_per_replica=cpus_per_replica, sampling_params=check_defaults(sampling_params),
                     batch_size=batch_size,
                     max_pending_requests=max_pending_requests or batch_size * max_concurrent_batches,
                     max_concurrent_batches=max_concurrent_batches, preserve_order=preserve_order,
                     core=core, engine_options=dict(engine_options), chat_template=chat_template,
                     chat_template_kwargs=dict(chat_template_kwargs or {}), text_as_chat=text_as_chat)
