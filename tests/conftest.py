import os

import pytest
import torch

# Triton kernels run on the CPU through Triton's interpreter when there is no GPU.
# This must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The processes that tests start (servers, engine cores, the CLI, TP and DP workers) run their
# torch ops on one OpenMP thread: next to the test process and their own event loop and core
# threads they oversubscribe two cores, where an OpenMP barrier waits out whole scheduler
# quanta (a SmolLM2 server's 6-token request: 7 s of CPU with two threads, 0.5 s with one).
# This process runs one thread too: tiny models gain nothing from two (test_async's mixed
# workload 54 -> 10 s of CPU on the loaded 2-core machine), and nor do the transformers oracles
# of real models there (SmolLM2's greedy test 29 s of CPU with one, 90 s with two; Gemma 3
# 270M's 56 and 59 s). An OMP_NUM_THREADS already set wins, here and in the children.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quick_sample(n): the quick tier (scripts/test.sh --quick) runs the first n "
        "parametrizations of this test (QUICK_CASES without the mark); the others are marked slow")


def pytest_collection_modifyitems(config, items):
    _ray_modules_last(items)
    _quick_samples(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _ray_modules_last(items) -> None:
    """The modules that use `ray_cluster` run last, one after another (in their own order),
    so that the one cluster serves them all and idles during no other test (an idle Ray
    cluster took ~7% of a core on the 2-core CI machine)."""
    ray_modules = {item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path in ray_modules)  # stable: the order is kept otherwise


# parametrizations of a test the quick tier keeps unless quick_sample says: one (the second
# cases were 25 of the quick tier's 130 s of CPU on the loaded 2-core machine)
QUICK_CASES = 1


def _quick_samples(items) -> None:
    """A parametrized test keeps its first QUICK_CASES parametrizations (or n, when marked
    `quick_sample(n)`) in the quick tier; the rest are marked slow (a few cases check a path on
    every change; CI runs them all)."""
    seen: dict = {}
    for item in items:
        mark = item.get_closest_marker("quick_sample")
        if mark is None and not hasattr(item, "callspec"):
            continue
        key = (item.path, getattr(item, "originalname", item.name))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > (mark.args[0] if mark is not None else QUICK_CASES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs, no dashboard) that this process drives, for every
    Ray test of the session (a start costs ~5 s, a shutdown ~1.5 s), started by
    slipstream's own `init_ray`."""
    from slipstream.ray import init_ray

    ray = init_ray(num_cpus=2, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> (folder, hf_model): a tiny random HF model saved once per session."""
    from helpers import make_hf_model

    made = {}

    def get(kind: str):
        if kind not in made:
            folder = str(tmp_path_factory.mktemp(f"tiny-{kind}"))
            made[kind] = (folder, make_hf_model(kind, folder))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def smollm2_transformers():
    """The transformers oracle of the embedded model (helpers.smollm2_hf), loaded once per
    session: transformers' own GGUF reader takes ~20 s a load on the CI machine."""
    from helpers import smollm2_hf
    return smollm2_hf()


@pytest.fixture(scope="session")
def tokenized_tiny(tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer (async_mix.make_tokenized_tiny_llama)."""
    from async_mix import make_tokenized_tiny_llama
    folder = str(tmp_path_factory.mktemp("tiny-tok"))
    make_tokenized_tiny_llama(folder)
    return folder


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """The CLI and `slipstream bench` freeze the collector's heap after start
    (`engine.freeze_gc`); tests run them in-process, so thaw it after each test (frozen
    objects would otherwise outlive the session and its engines)."""
    yield
    import gc
    if gc.get_freeze_count():
        gc.unfreeze()
