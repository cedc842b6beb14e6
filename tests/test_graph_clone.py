"""The second IO slot's CUDA graphs cloned from the first's (runner/graph_clone.py), the
parts that run without a GPU: which argument words are re-pointed and where to, the slots'
buffers the map is made of, the fallback to capturing when there is no driver, and the whole
walk over a graph's nodes through a fake driver over host memory.  The clones themselves are
checked on the GPU (tests/test_gpu_graph_clone.py)."""
import ctypes

import numpy as np
import pytest
import torch

from slipstream.config import EngineConfig
from slipstream.runner.graph_clone import AddressMap, SlotGraphCloner
from slipstream.runner.graph_nodes import (CloneUnsupported, Driver, KernelLayout, argument_words, extra_array,
                                          extra_buffer)
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


def test_remap_rewrites_only_the_words_inside_a_buffer_of_every_buffer_at_once():
    m = AddressMap.swap([(0x7F0000001000, 0x100)], [(0x7F0000009000, 0x100)])
    word = lambda v: v.to_bytes(8, "little")
    first = word(0x7F0000001010) + word(42) + word(0x7F0000009000)
    second = word(7) + word(0x7F00000010FF)  # the last byte of the buffer
    third = bytes(4) + word(0x7F0000001100)  # one past its end, at an unaligned offset
    changed = m.remap([first, second, third], [np.array([0, 8, 16]), np.array([0, 8]), np.array([4])])
    assert sorted(changed) == [0, 1]  # the third: nothing in a buffer
    assert bytes(changed[0]) == word(0x7F0000009010) + word(42) + word(0x7F0000001000)
    assert bytes(changed[1]) == word(7) + word(0x7F00000090FF)
    assert m.remap([first], [np.array([8])]) == {}  # 42 is no address of a slot
    assert m.remap([], []) == {}
    moved = m.moved(np.array([0x7F0000001000, 0x7F0000000FFF, 0x7F0000009080, 0], dtype=np.uint64))
    assert moved.tolist() == [0x7F0000009000, 0, 0x7F0000001080, 0]


def test_argument_words_are_pointer_sized_arguments_and_the_aligned_words_of_structs():
    # a pointer, two int32s (never addresses), a pointer, a 20-byte struct at offset 28
    args = [(0, 8), (8, 4), (12, 4), (16, 8), (28, 20)]
    assert argument_words(args) == [0, 16, 32, 40]
    assert argument_words([(0, 4), (4, 4)]) == []


def test_a_kernel_layout_reads_its_address_words_in_one_call_packed_or_scattered():
    """The clone reads a node's arguments once (they lie packed in the driver's copy) and
    unpacks only the words that may be addresses; scattered arguments are gathered."""
    layout = KernelLayout(((0, 8), (8, 4), (12, 4), (16, 8), (28, 20)))
    assert layout.span == 48 and layout.words == (0, 16, 32, 40) and layout.word_offsets.tolist() == [0, 16, 32, 40]
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
    assert layout.values(gathered).tolist() == values
    assert gathered[8:12] == packed[8:12] and gathered[28:48] == packed[28:48]
    assert layout.within(24).words == (0, 16) and layout.within(48) is layout
    odd = KernelLayout(((0, 4), (4, 8)))  # an 8-byte struct of two int32s at offset 4
    assert odd.words == (4,) and odd.values(bytes(4) + (0x7F0000001234).to_bytes(8, "little")).tolist() == [0x7F0000001234]


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
    m = AddressMap.swap([(0x7F0000001000, 0x100)], [(0x7F0000009000, 0x100)])
    packed = bytearray((7).to_bytes(4, "little") + bytes(4) + (0x7F0000001040).to_bytes(8, "little"))
    extra, parts = extra_array(packed)
    address, size = extra_buffer(ctypes.addressof(extra))
    assert size == 16 and ctypes.string_at(address, size) == bytes(packed)
    copy = m.remap([ctypes.string_at(address, size)], [np.arange(0, size - 7, 8)])[0]
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


def test_the_structured_output_buffers_join_the_map_once_both_slots_have_them():
    cpu = torch.device("cpu")
    slots = [IOSlot(i, 64, 8, 16, cpu, Streams(cpu)) for i in (0, 1)]
    cloner = SlotGraphCloner(slots)
    assert len(slots[0].device_buffers()) == 4
    for slot in slots:
        slot.deferred_sampling_buffers(vocab_size=100, hidden_size=32, dtype=torch.float32)
    a, b = slots
    assert cloner.map.get(a.sample_hidden.data_ptr()) is None  # (mapped at start: not yet)
    cloner.remap(slots)
    assert len(a.device_buffers()) == 6
    assert cloner.map.get(a.sample_hidden.data_ptr() + 8) == b.sample_hidden.data_ptr() + 8
    assert cloner.map.get(b.token_bitmask(100)[1].data_ptr()) == a.token_bitmask(100)[1].data_ptr()


def test_without_a_cuda_driver_the_cloner_says_why_and_clones_nothing(monkeypatch):

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

    from slipstream.cli.options import engine_args, engine_kwargs
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
    engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["cuda_graph_clone"] is True
    assert engine_kwargs(parser.parse_args(["--no-cuda-graph-clone"]))["cuda_graph_clone"] is False


class _FakeLib:
    """A CUDA driver over host memory, as `Driver.lib`: a graph of the given nodes (kernel
    nodes with scattered or packed arguments, memcpy, memset, other kinds); records what the
    clone sets.  Node handles are 1, 2, ...; each node is a dict."""

    def __init__(self, nodes: list[dict]) -> None:
        self.nodes, self.alive, self.set, self.flags, self.destroyed = nodes, [], {}, None, []

    @staticmethod
    def _out(ref):  # the object a ctypes.byref() points at
        return ref._obj

    def cuGraphClone(self, out, graph):
        self._out(out).value = 0xC10E
        return 0

    def cuGraphGetNodes(self, graph, nodes, count):
        if nodes is None:
            self._out(count).value = len(self.nodes)
        else:
            for i in range(len(self.nodes)):
                nodes[i] = i + 1
        return 0

    def cuGraphNodeGetType(self, node, kind):
        self._out(kind).value = self.nodes[node.value - 1]["type"]
        return 0

    def cuGraphKernelNodeGetParams_v2(self, node, ref):
        n, p = self.nodes[node.value - 1], self._out(ref)
        p.func = n["func"]
        if "packed" in n:
            extra, parts = extra_array(bytearray(n["packed"]))
            self.alive += [extra, parts]
            p.extra, p.kernel_params = ctypes.addressof(extra), None
        else:
            bufs = [ctypes.create_string_buffer(value, len(value)) for value in n["args"]]
            pointers = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
            self.alive += [bufs, pointers]
            p.kernel_params, p.extra = ctypes.addressof(pointers), None
        return 0

    def cuFuncGetParamInfo(self, func, index, offset, size):
        layout = next(n["layout"] for n in self.nodes if n.get("func") == func.value)
        if index.value >= len(layout):
            return 1  # CUDA_ERROR_INVALID_VALUE: past the last parameter
        self._out(offset).value, self._out(size).value = layout[index.value]
        return 0

    def cuGraphKernelNodeSetParams_v2(self, node, ref):
        p = self._out(ref)
        if p.extra:
            address, size = extra_buffer(p.extra)
            self.set[node.value] = ctypes.string_at(address, size)
        else:
            layout = self.nodes[node.value - 1]["layout"]
            pointers = (ctypes.c_void_p * len(layout)).from_address(p.kernel_params)
            self.set[node.value] = [ctypes.string_at(pointers[i], n) for i, (_, n) in enumerate(layout)]
        return 0

    def _raw_get(self, node, raw):
        ctypes.memmove(raw, self.nodes[node.value - 1]["raw"], len(raw))
        return 0

    def _raw_set(self, node, raw):
        self.set[node.value] = bytes(raw.raw)
        return 0

    cuGraphMemcpyNodeGetParams = cuGraphMemsetNodeGetParams = _raw_get
    cuGraphMemcpyNodeSetParams = cuGraphMemsetNodeSetParams = _raw_set

    def cuGraphInstantiateWithFlags(self, out, graph, flags):
        self._out(out).value, self.flags = 0xE0E, flags.value
        return 0

    def cuGraphDestroy(self, graph):
        self.destroyed.append(graph.value)
        return 0


class _FakeDriver(Driver):
    """Driver with its calls going to a _FakeLib (no libcuda), and their names recorded."""

    def __init__(self, nodes: list[dict]) -> None:  # (not Driver's: it loads libcuda)
        self.lib, self.timings, self.layouts, self.packed = _FakeLib(nodes), None, {}, {}
        self.calls: list[str] = []

    def call(self, name: str, *args) -> None:
        self.calls.append(name)
        super().call(name, *args)


def test_a_clone_is_instantiated_with_torchs_flags_and_never_uploaded():
    # An executable uploaded on the compute stream (cuGraphUpload) made the 8B decode loop's
    # steps 2% slower, cloned or not (docs/benchmarks.md, "Engine start"): a clone is left to
    # upload at its first launch, as torch leaves its own.
    from slipstream.runner.graph_clone import TORCH_INSTANTIATE_FLAGS, clone_graph
    driver = _FakeDriver([])
    phases: dict[str, float] = {}
    cloned = clone_graph(driver, 0x1234, AddressMap.swap([], []), phases)
    assert driver.calls == ["cuGraphClone", "cuGraphGetNodes", "cuGraphGetNodes", "cuGraphInstantiateWithFlags"]
    assert driver.lib.destroyed == [0xC10E]  # the copy, once instantiated
    assert driver.lib.flags == TORCH_INSTANTIATE_FLAGS == 1 | 8  # auto-free, node priority
    assert set(phases) == {"clone", "repoint", "instantiate"} and cloned.nodes_repointed == 0
    cloned.exec_handle = None  # (a fake executable: nothing to destroy)


def test_a_clone_re_points_every_node_kind_in_the_form_it_was_given():
    """The whole walk of clone_graph over a fake driver: a Triton-like kernel's scattered
    arguments, cuBLAS-like packed ones (an address inside a struct), a kernel with no slot
    address (left alone), memcpy and memset nodes, an empty node, a kernel with no word that
    could be an address (not read); then a host node."""
    from slipstream.runner.graph_clone import TORCH_INSTANTIATE_FLAGS, clone_graph
    A, B, OUT = 0x7F0000100000, 0x7F0000200000, 0x7F0000900000  # slot 0, slot 1, neither
    amap = AddressMap.swap([(A, 0x1000)], [(B, 0x1000)])

    def word(v):
        return v.to_bytes(8, "little")
    memcpy = bytearray(200)
    memcpy[48:56], memcpy[136:144] = word(A + 0x100), word(OUT)
    memset = bytearray(40)
    memset[0:8] = word(B + 8)
    struct_arg = bytes(8) + word(A + 0x40) + bytes(16)  # 32 bytes: an address in its second word
    nodes = [
        dict(type=0, func=0x11, layout=[(0, 8), (8, 4), (16, 8), (24, 8)],
             args=[word(A + 0x10), (7).to_bytes(4, "little"), word(OUT), word(B + 0x20)]),
        dict(type=0, func=0x22, layout=[(0, 8), (8, 4)], args=[word(OUT), (3).to_bytes(4, "little")]),
        dict(type=0, func=0x33, layout=[(0, 8), (8, 32)], packed=word(OUT) + struct_arg),
        dict(type=1, raw=bytes(memcpy)),
        dict(type=2, raw=bytes(memset)),
        dict(type=5),
        dict(type=0, func=0x44, layout=[(0, 4), (4, 4)], args=[(1).to_bytes(4, "little"), (2).to_bytes(4, "little")]),
    ]
    driver = _FakeDriver(nodes)
    cloned = clone_graph(driver, 0xAB, amap)
    lib = driver.lib
    assert cloned.nodes_repointed == 4 and sorted(lib.set) == [1, 3, 4, 5]  # not node 2
    assert lib.set[1] == [word(B + 0x10), (7).to_bytes(4, "little"), word(OUT), word(A + 0x20)]
    assert lib.set[3] == word(OUT) + bytes(8) + word(B + 0x40) + bytes(16)
    assert lib.set[4][48:56] == word(B + 0x100) and lib.set[4][136:144] == word(OUT)
    assert lib.set[4][:48] == memcpy[:48] and lib.set[4][144:] == memcpy[144:]
    assert lib.set[5][:8] == word(A + 8) and lib.set[5][8:] == memset[8:]
    assert lib.flags == TORCH_INSTANTIATE_FLAGS and lib.destroyed == [0xC10E]
    assert set(driver.layouts) == {(0x11, 0), (0x22, 0), (0x33, 0), (0x44, 0)} and set(driver.packed) == {(0x33, 0, 40)}
    cloned.exec_handle = None  # (a fake executable: nothing to destroy)

    host = _FakeDriver(nodes[:1] + [dict(type=3)])
    with pytest.raises(CloneUnsupported, match="graph node of type 3"):
        clone_graph(host, 0xAB, amap)
    assert host.lib.destroyed == [0xC10E] and host.lib.flags is None  # the copy freed, nothing instantiated
