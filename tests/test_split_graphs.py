"""When the split graphs of constrained steps are captured, cloned and replayed
(runner/split_graphs.py), with a stand-in for the step graphs' pool and capture (the graphs
themselves run on the GPU: tests/test_gpu_structured_outputs.py)."""
from types import SimpleNamespace

from slipstream.runner.inputs import StepPad, StepShape
from slipstream.runner.split_graphs import SplitGraphs
from slipstream.sampling.sampler import SamplerFlags


class FakeGraph:
    def __init__(self, work, cloned=False):
        self.work, self.cloned, self.replays = work, cloned, 0

    def replay(self):
        self.replays += 1


class FakeSteps:
    """What SplitGraphs reads of StepGraphs: a pool, the warm-up record, capture and clone."""

    def __init__(self, warm: bool):
        self.pool, self.cloner, self.capture_s, self.warm = object(), object(), 0.0, warm
        self.captured = []

    def kernels_warm(self, shape):
        return self.warm

    def capture_work(self, runner, work, keep=False):
        assert keep  # kept for the other slot's clone
        self.captured.append(work)
        return FakeGraph(work)

    def clone_for_other_slot(self, graph):
        return FakeGraph(graph.work, cloned=True)


def shape(flags=SamplerFlags(False, False, 0), size=8):
    return StepShape.padded_to(StepPad(size, size), True, flags, 256, decode_splits=2)


SLOTS = [SimpleNamespace(index=0), SimpleNamespace(index=1)]


def test_a_warm_forward_is_captured_at_first_use_and_the_other_slot_cloned():
    steps = FakeSteps(warm=True)
    split = SplitGraphs(steps)
    assert split.forward(None, SLOTS[0], shape())
    assert split.forward(None, SLOTS[1], shape())
    assert split.forward(None, SLOTS[0], shape())
    assert len(steps.captured) == 1 and split.replays["forward"] == [2, 1]
    assert split.graphs[split.forward_key(1, shape())].cloned
    unpadded = StepShape(5, 5, 5, 1, 256, SamplerFlags(False, False, 0), padded=False)
    assert not split.forward(None, SLOTS[0], unpadded)


def test_a_cold_forward_and_every_sampling_graph_wait_for_their_second_use():
    split = SplitGraphs(FakeSteps(warm=False))
    assert not split.forward(None, SLOTS[0], shape()) and split.forward(None, SLOTS[0], shape())
    for flags in (SamplerFlags(False, False, 0), SamplerFlags(True, False, 0)):
        assert not split.sample(None, SLOTS[0], shape(flags))
        assert split.sample(None, SLOTS[0], shape(flags))
    assert {k[3] for k in split.graphs if k[0] == "sample"} == {False, True}
    # penalties and logprobs sample eagerly, however often they come
    for flags in (SamplerFlags(False, True, 0), SamplerFlags(False, False, 2)):
        assert not any(split.sample(None, SLOTS[0], shape(flags)) for _ in range(3))


def test_no_pool_no_graphs():
    steps = FakeSteps(warm=True)
    steps.pool = None  # nothing captured at start (e.g. sizes used for padding alone)
    split = SplitGraphs(steps)
    assert not split.forward(None, SLOTS[0], shape()) and not split.sample(None, SLOTS[0], shape())
