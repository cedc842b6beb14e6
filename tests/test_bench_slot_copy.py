"""benchmarks/bench_slot_copy.py: the copies a graph shared by the two IO slots would add to
a step are what the slot's upload writes, and the sampled tokens back."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_slot_copy import shared_graph_copies  # noqa: E402

from slipstream.runner.pipeline import Streams  # noqa: E402
from slipstream.runner.slots import IOSlot  # noqa: E402


def test_the_copies_move_a_steps_inputs_into_the_graphs_slot_and_its_tokens_back():
    cpu = torch.device("cpu")
    graph_slot, step_slot = (IOSlot(i, 64, 8, 16, cpu, Streams(cpu)) for i in (0, 1))
    step_slot.host_int.copy_(torch.arange(step_slot.host_int.numel(), dtype=torch.int32))
    step_slot.host_float.uniform_()
    step_slot.upload(3)
    graph_slot.dev.tokens.copy_(torch.arange(8, dtype=torch.int32) + 100)
    copy_in, copy_out = shared_graph_copies(graph_slot, step_slot, num_seqs=3, num_samples=3)
    for dst, src in copy_in + copy_out:
        dst.copy_(src)
    end = step_slot.block_table_offset + 3 * 16  # the block table's first 3 rows
    assert torch.equal(graph_slot.dev_int[:end], step_slot.host_int[:end])
    assert int(graph_slot.dev_int[end]) == 0  # rows past the batch are not copied
    assert torch.equal(graph_slot.dev_float, step_slot.host_float)
    assert step_slot.dev.tokens[:3].tolist() == [100, 101, 102] and int(step_slot.dev.tokens[3]) == 0
