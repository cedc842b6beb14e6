"""The second IO slot's CUDA graphs cloned from the first's (runner/graph_clone.py), the
parts that run without a GPU: which argument words are re-pointed and where to, the slots'
buffers the map is made of, and the fallback to capturing when there is no driver.  The
clones themselves are checked on the GPU (tests/test_gpu_graph_clone.py)."""
import pytest
import torch

from slipstream.config import EngineConfig
from slipstream.runner.graph_clone import AddressMap, SlotGraphCloner, argument_words
from slipstream.runner.pipeline import Streams
from slipstream.runner.slots import IOSlot


def test_swap_moves_each_buffer_to_the_other_slots_and_back():
    m = AddressMap.swap([(0x1000, 0x100), (0x5000, 0x10)], [(0x9000, 0x100), (0xA000, 0x10)])
    assert m.get(0x1000) == 0x9000 and m.get(0x10FF) == 0x90FF
    assert m.get(0x9080) == 0x1080 and m.get(0x5008) == 0xA008 and m.get(0xA000) == 0x5000
    assert m.get(0x1100) is None  # one past the end: not the buffer's (half-open)
    assert m.get(0x0FFF) is None and m.get(0xB000) is None and m.get(3) is None
    with pytest.raises(ValueError, match="differ"):
        AddressMap.swap([(0x1000, 0x100)], [(0x9000, 0x80)])


def test_remap_words_rewrites_only_the_words_inside_a_buffer():
    m = AddressMap.swap([(0x7F0000001000, 0x100)], [(0x7F0000009000, 0x100)])
    data = bytearray((0x7F0000001010).to_bytes(8, "little") + (42).to_bytes(8, "little")
                     + (0x7F0000009000).to_bytes(8, "little"))
    assert m.remap_words(data, [0, 8, 16])
    assert [int.from_bytes(data[i:i + 8], "little") for i in (0, 8, 16)] == [0x7F0000009010, 42, 0x7F0000001000]
    untouched = bytearray(data)
    assert not m.remap_words(untouched, [8])  # 42 is no address of a slot
    assert untouched == data


def test_argument_words_are_pointer_sized_arguments_and_the_aligned_words_of_structs():
    # a pointer, two int32s (never addresses), a pointer, a 20-byte struct at offset 28
    args = [(0, 8), (8, 4), (12, 4), (16, 8), (28, 20)]
    assert argument_words(args) == [0, 16, 32, 40]
    assert argument_words([(0, 4), (4, 4)]) == []


def test_slots_list_their_device_buffers_alike():
    cpu = torch.device("cpu")
    a, b = (IOSlot(i, 64, 8, 16, cpu, Streams(cpu)) for i in (0, 1))
    bufs_a, bufs_b = a.device_buffers(), b.device_buffers()
    assert [n for _, n in bufs_a] == [n for _, n in bufs_b]
    assert bufs_a[0] == (a.dev_int.data_ptr(), a.dev_int.numel() * 4)
    assert (a.dev.tokens.data_ptr(), a.dev.tokens.numel() * 4) in bufs_a
    m = AddressMap.swap(bufs_a, bufs_b)  # every input view is inside the first buffer
    assert m.get(a.dev.block_table.data_ptr()) == b.dev.block_table.data_ptr()
    assert m.get(b.dev.positions.data_ptr()) == a.dev.positions.data_ptr()


def test_without_a_cuda_driver_the_cloner_says_why_and_clones_nothing(monkeypatch):
    import ctypes

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    cpu = torch.device("cpu")
    cloner = SlotGraphCloner([IOSlot(i, 64, 8, 16, cpu, Streams(cpu)) for i in (0, 1)])
    assert cloner.clone(object(), None) is None
    assert "no CUDA driver library" in cloner.unsupported and cloner.cloned == 0
    assert cloner.clone(object(), None) is None  # (and it does not try again)


def test_cloning_is_on_by_default_and_off_with_tensor_parallelism():
    from slipstream.core.engine_core import EngineCore
    assert EngineConfig().cuda_graph_clone
    for tp, expected in ((1, True), (2, False)):
        core = EngineCore.__new__(EngineCore)
        core.config, core.max_model_len, core._gpu_used_at_start = EngineConfig(tensor_parallel_size=tp), 256, 0
        assert core._runner_options(64).cuda_graph_clone is expected
    core.config = EngineConfig(cuda_graph_clone=False)
    assert not core._runner_options(64).cuda_graph_clone
