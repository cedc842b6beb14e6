"""CUDA graphs shared by the two IO slots (runner/graphs.py, ModelRunner.replay), on the CPU:
which shapes share, the copy of a slot's inputs into the graph slot, and the whole pipeline
with stand-in graphs that run the step they would have recorded on the slot they were
"captured" on, so the input copy, the carry-over from the other slot and the tokens copied
to the step's own slot decide the tokens."""
import collections

import pytest
import torch
from async_mix import mix, run_mix

from slipstream import LLM
from slipstream.config import EngineConfig
from slipstream.runner.graphs import SHARED, StepGraphs, capture_sizes
from slipstream.runner.pipeline import Streams
from slipstream.runner.slots import IOSlot


def test_decode_batches_from_shared_from_rows_and_mixed_steps_share_one_graph():
    graphs = StepGraphs(capture_sizes(12), [16, 32], 12, 256, shared_from=8)
    owners = collections.defaultdict(set)
    for shape in graphs.startup_shapes():
        for i in (0, 1):
            owners[(shape.is_decode, shape.num_seqs, shape.num_tokens)].add(graphs.key(i, shape)[0])
    assert owners == {(True, 1, 1): {0, 1}, (True, 2, 2): {0, 1}, (True, 4, 4): {0, 1},
                      (True, 8, 8): {SHARED}, (True, 12, 12): {SHARED},
                      (False, 12, 16): {SHARED}, (False, 12, 32): {SHARED}}
    per_slot = StepGraphs(capture_sizes(12), [16, 32], 12, 256, shared_from=13)
    assert not any(per_slot.shares(s) for s in per_slot.startup_shapes())
    assert not any(StepGraphs(capture_sizes(12), [16], 12, 256).shares(s) for s in graphs.startup_shapes())


def test_copy_inputs_from_copies_what_the_upload_wrote_for_the_batchs_rows():
    cpu = torch.device("cpu")
    graph_slot, step_slot = (IOSlot(i, 64, 8, 16, cpu, Streams(cpu)) for i in (2, 0))
    assert int(step_slot.host.slot_index[0]) == 0 and int(graph_slot.host.slot_index[0]) == 2
    step_slot.host.temperature[:] = 0.5  # a float input, in the same buffer
    step_slot.host_int[step_slot.block_table_offset:] = torch.arange(8 * 16, dtype=torch.int32) + 1
    step_slot.upload(3)
    graph_slot.copy_inputs_from(step_slot, 3)
    end = step_slot.block_table_offset + 3 * 16  # the block table's first 3 rows
    assert torch.equal(graph_slot.dev_int[:end], step_slot.host_int[:end])
    assert int(graph_slot.dev.slot_index[0]) == 0  # whose step the graph slot now holds
    assert (graph_slot.dev.temperature == 0.5).all()
    assert int(graph_slot.dev_int[end]) == 0  # rows past the batch are not copied


def test_cuda_graph_shared_from_is_checked():
    assert EngineConfig().cuda_graph_shared_from is None  # a graph per slot unless asked
    assert EngineConfig(cuda_graph_shared_from=8).cuda_graph_shared_from == 8
    with pytest.raises(ValueError, match="cuda_graph_shared_from"):
        EngineConfig(cuda_graph_shared_from=0)


class StandInGraph:
    """What a captured graph replays: the step on the slot it was captured on, as
    `StepGraphs._capture_one` captures it (a shared graph's with shared=True)."""

    def __init__(self, runner, slot, shape, shared: bool, replays: collections.Counter) -> None:
        self.runner, self.slot, self.shape, self.shared, self.replays = runner, slot, shape, shared, replays

    def replay(self) -> None:
        self.runner.compute_step(self.slot, self.shape, shared=self.shared)
        self.replays[SHARED if self.shared else self.slot.index] += 1


def stand_in_graphs(runner, shared_from: int) -> collections.Counter:
    """Give a CPU runner the graphs of a CUDA one (sizes, keys, graph slot), as stand-ins."""
    runner.graphs = graphs = StepGraphs(capture_sizes(12), [16, 32, 48, 64], 12, 256, shared_from=shared_from)
    runner.graph_slot = runner.new_slot(2)
    replays = collections.Counter()
    for shape in graphs.startup_shapes():
        shared = graphs.shares(shape)
        for slot in [runner.graph_slot] if shared else runner.slots:
            graphs.graphs[graphs.key(slot.index, shape)] = StandInGraph(runner, slot, shape, shared, replays)
    return replays


@pytest.mark.parametrize("sampled", [False, True])
def test_shared_graphs_give_the_tokens_of_graphs_per_slot_and_of_eager_steps(tokenized_tiny, sampled):
    """Async, so most steps carry the previous step's tokens over; a shared graph's step
    has them carried into its own slot, its inputs copied to the graph slot and its tokens
    copied back, and the outputs equal the eager engine's and those with a graph per slot."""
    reqs = mix(tokenized_tiny, sampled=sampled)
    common = dict(device="cpu", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=64,
                  max_num_seqs=12, debug_kv=True, async_scheduling=True)
    plain = run_mix(LLM(tokenized_tiny, **common), reqs)
    for shared_from, owners in ((8, {0, 1, SHARED}), (13, {0, 1})):
        llm = LLM(tokenized_tiny, **common)
        replays = stand_in_graphs(llm.engine.runner, shared_from)
        assert run_mix(llm, reqs) == plain
        assert {o for o, n in replays.items() if n} == owners, replays
