"""The other IO slot's CUDA graph of a step, made from this slot's instead of captured.

A capture costs Python launching the step's 150-350 kernels (15-25 ms on the H200's hosts,
most of the engine's start: docs/benchmarks.md, "Engine start"), and the two slots' graphs
of one shape differ only in the addresses of the slots' own buffers: the same kernels,
grids and scratch memory.  So the second slot's graph is a copy of the first's
(`cuGraphClone`) in which every node argument that points into one slot's buffers points
at the same offset of the other's, instantiated and launched through the driver API
(runner/graph_nodes.py reads and writes the nodes).  The
scratch memory stays where the first graph has it: graphs of the pool never run at once
(one compute stream).

What is re-pointed: 8-byte kernel arguments, and the 8-byte-aligned words of larger ones
(the structs cuBLAS and torch pass by value), that fall inside a slot buffer, whether a
launch passed them one by one or packed in one buffer (`extra`); the source
and destination of memcpy nodes and the destination of memset nodes.  Any other node kind
(host callbacks, memory allocation, conditionals, child graphs) makes `clone_graph` raise
`CloneUnsupported`, and the caller captures instead.  Bit-equal outputs of a clone and a
capture are checked on the GPU (tests/test_gpu_graph_clone.py).  On by default
(EngineConfig.cuda_graph_clone); the steps run as fast as with captured graphs once the
clone is not uploaded ahead of its first launch (`clone_graph`; docs/benchmarks.md,
"Engine start").
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import time
from dataclasses import dataclass, field

import torch

from slipstream.runner.graph_nodes import CloneUnsupported, Driver, extra_array, graph_nodes, kernel_arguments

log = logging.getLogger("slipstream.runner")

_NODE_KERNEL, _NODE_MEMCPY, _NODE_MEMSET, _NODE_EMPTY = 0, 1, 2, 5
_NODE_WAIT_EVENT, _NODE_EVENT_RECORD = 6, 7
_PLAIN_NODES = {_NODE_EMPTY, _NODE_WAIT_EVENT, _NODE_EVENT_RECORD}  # no addresses in them
_MEMCPY3D_SIZE = 200  # sizeof(CUDA_MEMCPY3D)
_MEMCPY_SRC_DEVICE, _MEMCPY_DST_DEVICE = 48, 136  # its srcDevice and dstDevice offsets
_MEMSET_SIZE = 40  # sizeof(CUDA_MEMSET_NODE_PARAMS); dst at offset 0
# as torch instantiates its graphs: CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH | _USE_NODE_PRIORITY
TORCH_INSTANTIATE_FLAGS = 1 | 8


@dataclass(frozen=True)
class AddressMap:
    """Half-open device address ranges [start, start + size) moved to another start."""
    ranges: tuple[tuple[int, int, int], ...]  # (start, size, new start), disjoint
    low: int = field(init=False)  # where the ranges begin and end: most words fall outside
    high: int = field(init=False)
    starts: tuple[int, ...] = field(init=False)  # the ranges' starts, sorted (bisected)
    ordered: tuple[tuple[int, int, int], ...] = field(init=False)  # the ranges in that order

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.ranges))
        object.__setattr__(self, "ordered", ordered)
        object.__setattr__(self, "starts", tuple(s for s, _, _ in ordered))
        object.__setattr__(self, "low", min((s for s, _, _ in self.ranges), default=0))
        object.__setattr__(self, "high", max((s + n for s, n, _ in self.ranges), default=0))

    @staticmethod
    def swap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> "AddressMap":
        """Each buffer (pointer, bytes) of `a` to the same-sized one at the same index of `b`
        and back: the two IO slots' buffers, whose graphs read each other's tokens."""
        if len(a) != len(b) or any(sa != sb for (_, sa), (_, sb) in zip(a, b)):
            raise ValueError("the two slots' buffers differ in count or size")
        return AddressMap(tuple((pa, s, pb) for (pa, s), (pb, _) in zip(a, b))
                          + tuple((pb, s, pa) for (pa, s), (pb, _) in zip(a, b)))

    def get(self, address: int) -> int | None:
        if not self.low <= address < self.high:
            return None
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        start, size, new = self.ordered[i]
        return new + address - start if address < start + size else None

    def remap_words(self, data: bytearray, offsets, values=None) -> bool:
        """Re-point the 8-byte little-endian words of `data` at `offsets` in place (`values`:
        those words, if already read); whether any changed."""
        if values is None:
            values = [int.from_bytes(data[off:off + 8], "little") for off in offsets]
        low, high, changed = self.low, self.high, False
        for off, value in zip(offsets, values):
            if low <= value < high:  # (the rare word worth a lookup)
                new = self.get(value)
                if new is not None:
                    data[off:off + 8] = new.to_bytes(8, "little")
                    changed = True
        return changed

    def touches(self, values) -> bool:
        """Whether any of the words `values` may point into a range (a cheap first look)."""
        low, high = self.low, self.high
        return any(low <= v < high for v in values)


@dataclass
class ClonedGraph:
    """An instantiated clone; `replay` launches it on the current stream, as
    torch.cuda.CUDAGraph.replay does."""
    driver: Driver
    exec_handle: ctypes.c_void_p | None
    nodes_repointed: int = 0

    def replay(self) -> None:
        self.driver.call("cuGraphLaunch", self.exec_handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))

    def __del__(self) -> None:
        if self.exec_handle:
            try:
                self.driver.lib.cuGraphExecDestroy(self.exec_handle)
            except Exception:  # (interpreter shutdown)
                pass
            self.exec_handle = None


def clone_graph(driver: Driver, graph_handle: int, amap: AddressMap,
                phases: dict[str, float] | None = None, flags: int = TORCH_INSTANTIATE_FLAGS) -> ClonedGraph:
    """Instantiate (with `flags`) a copy of the captured graph `graph_handle` (cudaGraph_t)
    re-pointed by `amap`.  `phases` (benchmarks): seconds of clone, repoint and instantiate
    added to it.

    Not uploaded (`cuGraphUpload`), as torch does not upload its own: an executable uploaded
    on the compute stream ran every later step of the 8B decode loop 2% slower, cloned or
    not, while the same executable left to upload at its first launch ran as fast as a
    capture (docs/benchmarks.md, "Engine start")."""
    marks = [time.perf_counter()]
    clone = ctypes.c_void_p()
    driver.call("cuGraphClone", ctypes.byref(clone), ctypes.c_void_p(graph_handle))
    keep: list = []  # the argument buffers set on nodes, alive until the graph is instantiated
    try:
        marks.append(time.perf_counter())
        repointed = _repoint_nodes(driver, clone, amap, keep)
        marks.append(time.perf_counter())
        exec_handle = ctypes.c_void_p()
        driver.call("cuGraphInstantiateWithFlags", ctypes.byref(exec_handle), clone, ctypes.c_ulonglong(flags))
    finally:
        driver.lib.cuGraphDestroy(clone)
    marks.append(time.perf_counter())
    cloned = ClonedGraph(driver, exec_handle, repointed)
    if phases is not None:
        for name, begin, end in zip(("clone", "repoint", "instantiate"), marks, marks[1:]):
            phases[name] = phases.get(name, 0.0) + end - begin
    return cloned


def _repoint_nodes(driver: Driver, graph: ctypes.c_void_p, amap: AddressMap, keep: list) -> int:
    """Re-point every node of `graph` in place; how many changed."""
    changed = 0
    for node in graph_nodes(driver, graph):
        kind = ctypes.c_int()
        driver.call("cuGraphNodeGetType", node, ctypes.byref(kind))
        if kind.value == _NODE_KERNEL:
            changed += _repoint_kernel(driver, node, amap, keep)
        elif kind.value == _NODE_MEMCPY:
            changed += _repoint_raw(driver, node, amap, "Memcpy", _MEMCPY3D_SIZE,
                                    (_MEMCPY_SRC_DEVICE, _MEMCPY_DST_DEVICE))
        elif kind.value == _NODE_MEMSET:
            changed += _repoint_raw(driver, node, amap, "Memset", _MEMSET_SIZE, (0,))
        elif kind.value not in _PLAIN_NODES:
            raise CloneUnsupported(f"graph node of type {kind.value}")
    return changed


def _repoint_kernel(driver: Driver, node: ctypes.c_void_p, amap: AddressMap, keep: list) -> bool:
    """Re-point a kernel node's arguments in the form they were given in; `keep` holds what
    the driver reads at instantiation."""
    p, layout, data, values = kernel_arguments(driver, node)
    if not values or not amap.touches(values):
        return False
    packed = bytearray(data)
    if not amap.remap_words(packed, layout.words, values):
        return False
    if p.extra:
        extra, parts = extra_array(packed)
        p.extra, p.kernel_params = ctypes.addressof(extra), None
        keep += [packed, extra, parts]
    else:
        buf = (ctypes.c_char * layout.span).from_buffer(packed)
        base = ctypes.addressof(buf)
        pointers = (ctypes.c_void_p * len(layout.arguments))(*[base + off for off, _ in layout.arguments])
        p.kernel_params = ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p))
        keep += [packed, buf, pointers]
    driver.call("cuGraphKernelNodeSetParams_v2", node, ctypes.byref(p))
    return True


def _repoint_raw(driver: Driver, node: ctypes.c_void_p, amap: AddressMap, kind: str, size: int,
                 address_offsets: tuple[int, ...]) -> bool:
    raw = (ctypes.c_char * size)()
    driver.call(f"cuGraph{kind}NodeGetParams", node, raw)
    data = bytearray(raw.raw)
    if not amap.remap_words(data, address_offsets):
        return False
    ctypes.memmove(raw, bytes(data), size)
    driver.call(f"cuGraph{kind}NodeSetParams", node, raw)
    return True


class SlotGraphCloner:
    """Makes one IO slot's graph of a step from the other slot's captured one (StepGraphs);
    after the first failure (an old driver, a node it cannot re-point) it says why and
    StepGraphs captures every graph."""

    def __init__(self, slots) -> None:
        self.map = AddressMap.swap(slots[0].device_buffers(), slots[1].device_buffers())
        self.driver: Driver | None = None
        self.unsupported: str | None = None  # why cloning stopped, if it did
        self.cloned = 0

    def clone(self, graph: torch.cuda.CUDAGraph) -> ClonedGraph | None:
        """The other slot's graph of `graph`'s step (captured with keep_graph=True), or None."""
        if self.unsupported is not None:
            return None
        try:
            self.driver = self.driver or Driver()
            cloned = clone_graph(self.driver, graph.raw_cuda_graph(), self.map)
        except CloneUnsupported as e:
            self.unsupported = str(e)
            log.warning("CUDA graphs: the second IO slot's graphs are captured, not cloned: %s", e)
            return None
        self.cloned += 1
        return cloned


__all__ = ["AddressMap", "ClonedGraph", "SlotGraphCloner", "TORCH_INSTANTIATE_FLAGS", "clone_graph"]
