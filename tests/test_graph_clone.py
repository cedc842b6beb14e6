"""The second IO slot's CUDA graphs cloned from the first's (runner/graph_clone.py), the
parts that run without a GPU: which argument words are re-pointed and where to, the slots'
buffers the map is made of, and the fallback to capturing when there is no driver.  The
clones themselves are checked on the GPU (tests/test_gpu_graph_clone.py)."""
import pytest
import torch

from slipstream.config import EngineConfig
from slipstream.runner.graph_clone import AddressMap, SlotGraphCloner
from slipstream.runner.graph_nodes import CloneUnsupported, KernelLayout, argument_words, extra_array, extra_buffer
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


def test_a_kernel_layout_reads_its_address_words_in_one_call_packed_or_scattered():
    """The clone reads a node's arguments once (they lie packed in the driver's copy) and
    unpacks only the words that may be addresses; scattered arguments are gathered."""
    import ctypes
    layout = KernelLayout(((0, 8), (8, 4), (12, 4), (16, 8), (28, 20)))
    assert layout.span == 48 and layout.words == (0, 16, 32, 40) and layout.reader.size == 48
    values = [0x7F0000001000, 0x7F0000001008, 0x7F0000002000, 5]
    packed = bytearray(48)
    for off, v in zip(layout.words, values):
        packed[off:off + 8] = v.to_bytes(8, "little")
    packed[8:12] = (3).to_bytes(4, "little")
    store = (ctypes.c_char * 48).from_buffer(packed)
    base = ctypes.addressof(store)
    together = (ctypes.c_void_p * 5)(*[base + off for off, _ in layout.arguments])
    assert layout.read(ctypes.addressof(together)) == bytes(packed)
    apart = [ctypes.create_string_buffer(bytes(packed[off:off + n]), n) for off, n in layout.arguments]
    scattered = (ctypes.c_void_p * 5)(*[ctypes.addressof(b) for b in apart])
    gathered = layout.read(ctypes.addressof(scattered))
    assert list(layout.reader.unpack_from(gathered)) == values
    assert gathered[8:12] == packed[8:12] and gathered[28:48] == packed[28:48]
    m = AddressMap.swap([(0x7F0000001000, 0x100)], [(0x7F0000009000, 0x100)])
    assert m.touches(values) and not m.touches([5, 0x7F0000010000])  # (a gap inside may pass: a first look)
    assert layout.within(24).words == (0, 16) and layout.within(48) is layout


def test_lookups_find_the_range_among_many_and_miss_the_gaps_between():
    a = [(0x10000 + 0x1000 * i, 0x100) for i in range(40)]
    b = [(0x90000 + 0x1000 * i, 0x100) for i in range(40)]
    m = AddressMap.swap(list(reversed(a)), list(reversed(b)))
    assert m.get(0x10000 + 0x1000 * 17 + 0x10) == 0x90000 + 0x1000 * 17 + 0x10
    assert m.get(0x90000 + 0x1000 * 39 + 0xFF) == 0x10000 + 0x1000 * 39 + 0xFF
    assert m.get(0x10000 + 0x1000 * 17 + 0x100) is None  # the gap after a buffer
    assert m.get(0x50000) is None  # between the two slots' buffers


def test_a_packed_argument_buffer_is_read_from_and_written_as_an_extra_array():
    """cuBLAS launches pass their arguments as one buffer (`extra`): the clone reads it,
    re-points its words and names its own copy in a new array of the same form."""
    import ctypes
    m = AddressMap.swap([(0x7F0000001000, 0x100)], [(0x7F0000009000, 0x100)])
    packed = bytearray((7).to_bytes(4, "little") + bytes(4) + (0x7F0000001040).to_bytes(8, "little"))
    extra, parts = extra_array(packed)
    address, size = extra_buffer(ctypes.addressof(extra))
    assert size == 16 and ctypes.string_at(address, size) == bytes(packed)
    copy = bytearray(ctypes.string_at(address, size))
    assert m.remap_words(copy, range(0, size - 7, 8))
    assert int.from_bytes(copy[8:], "little") == 0x7F0000009040 and copy[:8] == packed[:8]
    odd = (ctypes.c_void_p * 3)(9, 0, 0)  # a key that is no CU_LAUNCH_PARAM_*
    with pytest.raises(CloneUnsupported, match="key 9"):
        extra_buffer(ctypes.addressof(odd))
    empty = (ctypes.c_void_p * 1)(0)
    with pytest.raises(CloneUnsupported, match="no argument buffer"):
        extra_buffer(ctypes.addressof(empty))


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
    assert cloner.clone(object()) is None
    assert "no CUDA driver library" in cloner.unsupported and cloner.cloned == 0
    assert cloner.clone(object()) is None  # (and it does not try again)


def test_cloning_is_on_by_default_off_when_asked_and_never_with_tensor_parallelism():
    import argparse

    from slipstream.cli import _engine_args, _engine_kwargs
    from slipstream.core.engine_core import EngineCore
    assert EngineConfig().cuda_graph_clone
    for tp, expected in ((1, True), (2, False)):
        core = EngineCore.__new__(EngineCore)
        core.config = EngineConfig(tensor_parallel_size=tp)
        core.max_model_len, core._gpu_used_at_start = 256, 0
        assert core._runner_options(64).cuda_graph_clone is expected
    core.config = EngineConfig(cuda_graph_clone=False)
    assert not core._runner_options(64).cuda_graph_clone
    parser = argparse.ArgumentParser()
    _engine_args(parser)
    assert _engine_kwargs(parser.parse_args([]))["cuda_graph_clone"] is True
    assert _engine_kwargs(parser.parse_args(["--no-cuda-graph-clone"]))["cuda_graph_clone"] is False


class _RecordingDriver:
    """Stands in for Driver: records the API calls a clone makes; the graph has no nodes."""

    def __init__(self) -> None:
        import types
        self.calls: list[tuple[str, tuple]] = []
        self.lib = types.SimpleNamespace(cuGraphDestroy=lambda graph: self.calls.append(("cuGraphDestroy", ())))

    def call(self, name: str, *args) -> None:
        self.calls.append((name, args))


def test_a_clone_is_instantiated_with_torchs_flags_and_never_uploaded():
    # An executable uploaded on the compute stream (cuGraphUpload) made the 8B decode loop's
    # steps 2% slower, cloned or not (docs/benchmarks.md, "Engine start"): a clone is left to
    # upload at its first launch, as torch leaves its own.
    from slipstream.runner.graph_clone import TORCH_INSTANTIATE_FLAGS, clone_graph
    driver = _RecordingDriver()
    phases: dict[str, float] = {}
    cloned = clone_graph(driver, 0x1234, AddressMap.swap([], []), phases)
    names = [name for name, _ in driver.calls]
    assert names == ["cuGraphClone", "cuGraphGetNodes", "cuGraphGetNodes", "cuGraphInstantiateWithFlags",
                     "cuGraphDestroy"]
    assert driver.calls[3][1][2].value == TORCH_INSTANTIATE_FLAGS == 1 | 8  # auto-free, node priority
    assert set(phases) == {"clone", "repoint", "instantiate"} and cloned.nodes_repointed == 0
    cloned.exec_handle = None  # (nothing was instantiated: no executable to destroy)
