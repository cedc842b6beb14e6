"""The other IO slot's CUDA graph of a step, made from this slot's instead of captured.

A capture costs Python launching the step's 150-350 kernels (15-25 ms on the H200's hosts,
most of the engine's start: benchmarks/notes/benchmarks.md, "Engine start"), and the two slots' graphs
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
clone is not uploaded ahead of its first launch (`clone_graph`;
benchmarks/notes/benchmarks.md, "Engine start").
"""
from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from slipstream.runner.graph_nodes import (NODE_EMPTY, NODE_EVENT_RECORD, NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET,
                                          NODE_WAIT_EVENT, CloneUnsupported, Driver, extra_array, graph_nodes,
                                          kernel_arguments, word_values)

log = logging.getLogger("slipstream.runner")

_PLAIN_NODES = {NODE_EMPTY, NODE_WAIT_EVENT, NODE_EVENT_RECORD}  # no addresses in them
# memcpy and memset nodes: (name in the driver's calls, sizeof their parameters, the offsets
# of the addresses in them): CUDA_MEMCPY3D's srcDevice and dstDevice, CUDA_MEMSET_NODE_PARAMS' dst
_RAW_NODES = {NODE_MEMCPY: ("Memcpy", 200, np.array([48, 136], dtype=np.int64)),
              NODE_MEMSET: ("Memset", 40, np.array([0], dtype=np.int64))}
# as torch instantiates its graphs: CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH | _USE_NODE_PRIORITY
TORCH_INSTANTIATE_FLAGS = 1 | 8


@dataclass(frozen=True)
class AddressMap:
    """Half-open device address ranges [start, start + size) moved to another start."""
    ranges: tuple[tuple[int, int, int], ...]  # (start, size, new start), disjoint
    low: int = field(init=False)  # where the ranges begin and end: most words fall outside
    high: int = field(init=False)
    _table: np.ndarray = field(init=False, repr=False, compare=False)  # [3, n] uint64: starts (sorted), ends, new starts

    def __post_init__(self) -> None:
        ordered = sorted(self.ranges)
        object.__setattr__(self, "low", min((s for s, _, _ in ordered), default=0))
        object.__setattr__(self, "high", max((s + n for s, n, _ in ordered), default=0))
        table = np.array([[s for s, _, _ in ordered], [s + n for s, n, _ in ordered], [t for _, _, t in ordered]],
                         dtype=np.uint64).reshape(3, len(ordered))
        object.__setattr__(self, "_table", table)

    @staticmethod
    def swap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> "AddressMap":
        """Each buffer (pointer, bytes) of `a` to the same-sized one at the same index of `b`
        and back: the two IO slots' buffers, whose graphs read each other's tokens."""
        if len(a) != len(b) or any(sa != sb for (_, sa), (_, sb) in zip(a, b)):
            raise ValueError("the two slots' buffers differ in count or size")
        return AddressMap(tuple((pa, s, pb) for (pa, s), (pb, _) in zip(a, b))
                          + tuple((pb, s, pa) for (pa, s), (pb, _) in zip(a, b)))

    def get(self, address: int) -> int | None:
        moved = self.moved(np.array([address], dtype=np.uint64))
        return int(moved[0]) if moved[0] else None

    def moved(self, values: np.ndarray) -> np.ndarray:
        """Where each of `values` (uint64) moves, or 0 where it lies in no range."""
        out = np.zeros_like(values)
        inside = np.flatnonzero((values >= self.low) & (values < self.high))  # (most words: none)
        if inside.size:
            v = values[inside]
            starts, ends, news = self._table
            i = np.searchsorted(starts, v, side="right") - 1  # (>= 0: v >= the first start)
            hit = v < ends[i]
            out[inside[hit]] = news[i[hit]] + (v[hit] - starts[i[hit]])
        return out

    def remap(self, buffers: list[bytes], offsets: list[np.ndarray]) -> dict[int, bytearray]:
        """Re-point the 8-byte little-endian words of each of `buffers` at its `offsets` (int64
        arrays), all buffers in one pass: {index: the re-pointed copy} of those that changed."""
        if not buffers:
            return {}
        padded = [b + bytes(-len(b) % 8) for b in buffers]  # (8-aligned bases: word_values reads words)
        sizes = np.fromiter(map(len, padded), np.int64, len(padded))
        counts = np.fromiter(map(len, offsets), np.int64, len(offsets))
        bases = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        owner = np.repeat(np.arange(len(buffers)), counts)
        where = np.concatenate(offsets) + bases[owner]
        moved = self.moved(word_values(np.frombuffer(b"".join(padded), np.uint8), where))
        changed: dict[int, bytearray] = {}
        for k in np.flatnonzero(moved).tolist():
            b = int(owner[k])
            data = changed.get(b)
            if data is None:
                data = changed[b] = bytearray(buffers[b])
            off = int(where[k] - bases[b])
            data[off:off + 8] = int(moved[k]).to_bytes(8, "little")
        return changed


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
    capture (benchmarks/notes/benchmarks.md, "Engine start")."""
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
    """Re-point every node of `graph` in place; how many changed.  Every node's arguments
    are read first, then all their words are looked up at once (a graph has 20-30 K words
    that may be addresses, a few hundred of them into the slots), then the changed nodes set."""
    kernels, raws = [], []  # (node, its parameters, layout, bytes); (node, kind, bytes)
    kind = ctypes.c_int()
    for node in graph_nodes(driver, graph):
        driver.call("cuGraphNodeGetType", node, ctypes.byref(kind))
        if kind.value == NODE_KERNEL:
            p, layout, data = kernel_arguments(driver, node)
            if data:
                kernels.append((node, p, layout, data))
        elif kind.value in _RAW_NODES:
            name, size, _ = _RAW_NODES[kind.value]
            raw = (ctypes.c_char * size)()
            driver.call(f"cuGraph{name}NodeGetParams", node, raw)
            raws.append((node, kind.value, raw.raw))
        elif kind.value not in _PLAIN_NODES:
            raise CloneUnsupported(f"graph node of type {kind.value}")
    changed = amap.remap([data for *_, data in kernels + raws],
                         [layout.word_offsets for _, _, layout, _ in kernels]
                         + [_RAW_NODES[k][2] for _, k, _ in raws])
    for i, data in changed.items():
        if i < len(kernels):
            _set_kernel_arguments(driver, *kernels[i][:3], data, keep)
        else:
            node, k, _ = raws[i - len(kernels)]
            driver.call(f"cuGraph{_RAW_NODES[k][0]}NodeSetParams", node, (ctypes.c_char * len(data)).from_buffer(data))
            keep.append(data)
    return len(changed)


def _set_kernel_arguments(driver: Driver, node: ctypes.c_void_p, p, layout, packed: bytearray, keep: list) -> None:
    """Give a kernel node re-pointed arguments in the form it was given them; `keep` holds
    what the driver reads at instantiation."""
    if p.extra:
        extra, parts = extra_array(packed)
        p.extra, p.kernel_params = ctypes.addressof(extra), None
        keep += [packed, extra, parts]
    else:
        buf = (ctypes.c_char * layout.span).from_buffer(packed)
        base = ctypes.addressof(buf)
        pointers = (ctypes.c_void_p * len(layout.arguments))(*[base + off for off, _ in layout.arguments])
        p.kernel_params = ctypes.addressof(pointers)
        keep += [packed, buf, pointers]
    driver.call("cuGraphKernelNodeSetParams_v2", node, ctypes.byref(p))


class SlotGraphCloner:
    """Makes one IO slot's graph of a step from the other slot's captured one (StepGraphs);
    after the first failure (an old driver, a node it cannot re-point) it says why and
    StepGraphs captures every graph."""

    def __init__(self, slots) -> None:
        self.map = AddressMap.swap(slots[0].device_buffers(), slots[1].device_buffers())
        self.driver: Driver | None = None
        self.unsupported: str | None = None  # why cloning stopped, if it did
        self.cloned = 0

    def remap(self, slots) -> None:
        """Map the slots' buffers again (buffers allocated after start: structured outputs')."""
        self.map = AddressMap.swap(slots[0].device_buffers(), slots[1].device_buffers())

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
