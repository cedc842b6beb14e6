"""The other IO slot's CUDA graph of a step, made from this slot's instead of captured.

A capture costs Python launching the step's 150-350 kernels (15-25 ms on the H200's hosts,
most of the engine's start: docs/benchmarks.md, "Engine start"), and the two slots' graphs
of one shape differ only in the addresses of the slots' own buffers: the same kernels,
grids and scratch memory.  So the second slot's graph is a copy of the first's
(`cuGraphClone`) in which every node argument that points into one slot's buffers points
at the same offset of the other's, instantiated and launched through the driver API.  The
scratch memory stays where the first graph has it: graphs of the pool never run at once
(one compute stream).

What is re-pointed: 8-byte kernel arguments, and the 8-byte-aligned words of larger ones
(the structs cuBLAS and torch pass by value), that fall inside a slot buffer; the source
and destination of memcpy nodes and the destination of memset nodes.  Any other node kind
(host callbacks, memory allocation, conditionals, child graphs) makes `clone_graph` raise
`CloneUnsupported`, and the caller captures instead.  Bit-equal outputs of a clone and a
capture are checked on the GPU (tests/test_gpu_graph_clone.py).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger("slipstream.runner")

_NODE_KERNEL, _NODE_MEMCPY, _NODE_MEMSET, _NODE_EMPTY = 0, 1, 2, 5
_NODE_WAIT_EVENT, _NODE_EVENT_RECORD = 6, 7
_PLAIN_NODES = {_NODE_EMPTY, _NODE_WAIT_EVENT, _NODE_EVENT_RECORD}  # no addresses in them
_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE: past a function's last parameter
_MEMCPY3D_SIZE = 200  # sizeof(CUDA_MEMCPY3D)
_MEMCPY_SRC_DEVICE, _MEMCPY_DST_DEVICE = 48, 136  # its srcDevice and dstDevice offsets
_MEMSET_SIZE = 40  # sizeof(CUDA_MEMSET_NODE_PARAMS); dst at offset 0


class CloneUnsupported(RuntimeError):
    """A graph this module cannot re-point (the caller captures the step instead)."""


@dataclass(frozen=True)
class AddressMap:
    """Half-open device address ranges [start, start + size) moved to another start."""
    ranges: tuple[tuple[int, int, int], ...]  # (start, size, new start)
    low: int = field(init=False)  # where the ranges begin and end: most words fall outside
    high: int = field(init=False)

    def __post_init__(self) -> None:
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
        for start, size, new in self.ranges:
            if start <= address < start + size:
                return new + address - start
        return None

    def remap_words(self, data: bytearray, offsets) -> bool:
        """Re-point the 8-byte little-endian words of `data` at `offsets` in place; whether
        any changed."""
        changed = False
        for off in offsets:
            new = self.get(int.from_bytes(data[off:off + 8], "little"))
            if new is not None:
                data[off:off + 8] = new.to_bytes(8, "little")
                changed = True
        return changed


def argument_words(params: list[tuple[int, int]]) -> list[int]:
    """Offsets, in a kernel's packed argument buffer, of the words that may hold an address:
    every 8-byte argument and the 8-byte-aligned words of larger ones (`params`: each
    argument's (offset, size))."""
    words = []
    for off, size in params:
        if size == 8:
            words.append(off)
        elif size > 8:
            first = -(-off // 8) * 8
            words += range(first, off + size - 7, 8)
    return words


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("kernel_params", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class Driver:
    """The few driver API calls this needs (libcuda through ctypes), and what it learnt of
    each kernel's arguments."""

    NEEDED = ("cuGraphClone", "cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2",
              "cuGraphKernelNodeSetParams_v2", "cuFuncGetParamInfo", "cuKernelGetParamInfo",
              "cuGraphInstantiateWithFlags", "cuGraphUpload", "cuGraphLaunch", "cuGraphExecDestroy")

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CloneUnsupported(f"no CUDA driver library: {e}") from None
        missing = [n for n in self.NEEDED if not hasattr(self.lib, n)]
        if missing:
            raise CloneUnsupported(f"the CUDA driver lacks {', '.join(missing)} (needs 12.4 or later)")
        self.arguments: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (func, kern) -> (offset, size)s

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise CloneUnsupported(f"{name} failed (CUresult {rc})")

    def kernel_arguments(self, p: _KernelNodeParams) -> list[tuple[int, int]]:
        key = (p.func or 0, p.kern or 0)
        if key not in self.arguments:
            get, handle = ((self.lib.cuFuncGetParamInfo, p.func) if p.func else
                           (self.lib.cuKernelGetParamInfo, p.kern))
            found, off, size = [], ctypes.c_size_t(), ctypes.c_size_t()
            while True:
                rc = get(ctypes.c_void_p(handle), ctypes.c_size_t(len(found)), ctypes.byref(off), ctypes.byref(size))
                if rc == _INVALID_VALUE:
                    break
                if rc != 0:
                    raise CloneUnsupported(f"parameter info of a kernel failed (CUresult {rc})")
                found.append((off.value, size.value))
            self.arguments[key] = found
        return self.arguments[key]


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


def clone_graph(driver: Driver, graph_handle: int, amap: AddressMap, stream: int) -> ClonedGraph:
    """Instantiate a copy of the captured graph `graph_handle` (cudaGraph_t) re-pointed by
    `amap`, uploaded on `stream` (so that its first launch costs no more than a later one)."""
    clone = ctypes.c_void_p()
    driver.call("cuGraphClone", ctypes.byref(clone), ctypes.c_void_p(graph_handle))
    try:
        repointed = _repoint_nodes(driver, clone, amap)
        exec_handle = ctypes.c_void_p()
        driver.call("cuGraphInstantiateWithFlags", ctypes.byref(exec_handle), clone, ctypes.c_ulonglong(0))
    finally:
        driver.lib.cuGraphDestroy(clone)
    cloned = ClonedGraph(driver, exec_handle, repointed)
    driver.call("cuGraphUpload", exec_handle, ctypes.c_void_p(stream))
    return cloned


def _graph_nodes(driver: Driver, graph: ctypes.c_void_p) -> list[ctypes.c_void_p]:
    count = ctypes.c_size_t()
    driver.call("cuGraphGetNodes", graph, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    driver.call("cuGraphGetNodes", graph, nodes, ctypes.byref(count))
    return [ctypes.c_void_p(n) for n in nodes[:count.value]]


def _repoint_nodes(driver: Driver, graph: ctypes.c_void_p, amap: AddressMap) -> int:
    """Re-point every node of `graph` in place; how many changed."""
    changed = 0
    for node in _graph_nodes(driver, graph):
        kind = ctypes.c_int()
        driver.call("cuGraphNodeGetType", node, ctypes.byref(kind))
        if kind.value == _NODE_KERNEL:
            changed += _repoint_kernel(driver, node, amap)
        elif kind.value == _NODE_MEMCPY:
            changed += _repoint_raw(driver, node, amap, "Memcpy", _MEMCPY3D_SIZE,
                                    (_MEMCPY_SRC_DEVICE, _MEMCPY_DST_DEVICE))
        elif kind.value == _NODE_MEMSET:
            changed += _repoint_raw(driver, node, amap, "Memset", _MEMSET_SIZE, (0,))
        elif kind.value not in _PLAIN_NODES:
            raise CloneUnsupported(f"graph node of type {kind.value}")
    return changed


def _repoint_kernel(driver: Driver, node: ctypes.c_void_p, amap: AddressMap) -> bool:
    p = _KernelNodeParams()
    driver.call("cuGraphKernelNodeGetParams_v2", node, ctypes.byref(p))
    if p.extra:
        raise CloneUnsupported("a kernel node with `extra` arguments")
    arguments = driver.kernel_arguments(p)
    if not arguments:
        return False
    end = max(off + size for off, size in arguments)
    packed = bytearray(end)
    for i, (off, size) in enumerate(arguments):
        packed[off:off + size] = ctypes.string_at(p.kernel_params[i], size)
    if not amap.remap_words(packed, argument_words(arguments)):
        return False
    buf = (ctypes.c_char * end).from_buffer(packed)
    base = ctypes.addressof(buf)
    pointers = (ctypes.c_void_p * len(arguments))(*[base + off for off, _ in arguments])
    p.kernel_params = ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p))
    driver.call("cuGraphKernelNodeSetParams_v2", node, ctypes.byref(p))  # (the driver copies them)
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

    def clone(self, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> ClonedGraph | None:
        """The other slot's graph of `graph`'s step (captured with keep_graph=True), or None."""
        if self.unsupported is not None:
            return None
        try:
            self.driver = self.driver or Driver()
            cloned = clone_graph(self.driver, graph.raw_cuda_graph(), self.map, stream.cuda_stream)
        except CloneUnsupported as e:
            self.unsupported = str(e)
            log.warning("CUDA graphs: the second IO slot's graphs are captured, not cloned: %s", e)
            return None
        self.cloned += 1
        return cloned


__all__ = ["AddressMap", "ClonedGraph", "CloneUnsupported", "Driver", "SlotGraphCloner", "argument_words",
           "clone_graph"]
