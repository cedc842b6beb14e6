"""CUDA graph nodes read and written through the driver API (libcuda over ctypes), for
runner/graph_clone.py: the few driver calls it makes, each kernel's argument layout (asked of
the driver once per kernel), and a kernel node's arguments in either form a launch gives
them: an array of pointers to each argument, or one packed buffer (`extra`, as cuBLAS
launches)."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import numpy as np

# CUgraphNodeType: the kinds of graph node the clone meets
NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_EMPTY, NODE_WAIT_EVENT, NODE_EVENT_RECORD = 0, 1, 2, 5, 6, 7
_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE: past a function's last parameter
_PARAM_END, _PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE = 0, 1, 2  # the keys of a launch's `extra`


class CloneUnsupported(RuntimeError):
    """A graph this module cannot re-point (the caller captures the step instead)."""


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


_WORD_BYTES = np.arange(8, dtype=np.int64)


def word_values(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The 8-byte little-endian words of the bytes `data` (uint8) at byte `offsets`, as
    uint64, in one gather: of words where all are 8-aligned (pointers always are), else of
    bytes (an 8-byte struct of int32s may sit at offset 4)."""
    if len(data) % 8 == 0 and not (offsets & 7).any():
        return data.view("<u8")[offsets >> 3]
    return np.ascontiguousarray(data[offsets[:, None] + _WORD_BYTES]).view("<u8").reshape(-1)


@dataclass(frozen=True)
class KernelLayout:
    """A kernel's arguments as the clone reads them, worked out once per kernel: each
    argument's (offset, size), the bytes they span and the offsets of the words that may
    hold an address (an array, for word_values)."""
    arguments: tuple[tuple[int, int], ...]
    span: int = field(init=False)
    word_offsets: np.ndarray = field(init=False, repr=False, compare=False)
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)  # each argument's offset

    def __post_init__(self) -> None:
        object.__setattr__(self, "span", max((o + n for o, n in self.arguments), default=0))
        object.__setattr__(self, "word_offsets", np.array(argument_words(list(self.arguments)), dtype=np.int64))
        object.__setattr__(self, "_offsets", np.array([o for o, _ in self.arguments], dtype=np.uint64))

    @property
    def words(self) -> tuple[int, ...]:
        """`word_offsets` as a tuple."""
        return tuple(self.word_offsets.tolist())

    def values(self, data: bytes) -> np.ndarray:
        """The words of a packed argument buffer that may hold an address (uint64)."""
        return word_values(np.frombuffer(data, np.uint8), self.word_offsets)

    def within(self, size: int) -> "KernelLayout":
        """The same layout cut to a packed buffer of `size` bytes (a launch's `extra`)."""
        return self if self.span <= size else KernelLayout(tuple(a for a in self.arguments if sum(a) <= size))

    def read(self, params_address: int) -> bytes:
        """The packed arguments of a node whose parameters are `params_address`, an array of
        pointers to each argument: one read when they lie packed as the layout has them (as
        the driver keeps a node's), else one per argument."""
        pointers = np.frombuffer(ctypes.string_at(params_address, 8 * len(self.arguments)), "<u8")
        if pointers[0] and (pointers - pointers[0] == self._offsets).all():  # (so the first offset is 0)
            return ctypes.string_at(int(pointers[0]), self.span)
        packed = bytearray(self.span)
        for ptr, (off, size) in zip(pointers.tolist(), self.arguments):
            packed[off:off + size] = ctypes.string_at(ptr, size)
        return bytes(packed)


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),  # (void **, read as an address)
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class Driver:
    """The few driver API calls this needs (libcuda through ctypes), and what it learnt of
    each kernel's arguments."""

    NEEDED = ("cuGraphClone", "cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2",
              "cuGraphKernelNodeSetParams_v2", "cuFuncGetParamInfo", "cuKernelGetParamInfo",
              "cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphExecDestroy")

    def __init__(self, timed: bool = False) -> None:
        # name -> [seconds, calls] of each API call made through `call` (benchmarks)
        self.timings: dict[str, list] | None = {} if timed else None
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CloneUnsupported(f"no CUDA driver library: {e}") from None
        missing = [n for n in self.NEEDED if not hasattr(self.lib, n)]
        if missing:
            raise CloneUnsupported(f"the CUDA driver lacks {', '.join(missing)} (needs 12.4 or later)")
        self.layouts: dict[tuple[int, int], KernelLayout] = {}  # (func, kern) -> its arguments' layout
        self.packed: dict[tuple[int, int, int], KernelLayout] = {}  # (func, kern, bytes) -> the same, packed

    def call(self, name: str, *args) -> None:
        if self.timings is None:
            rc = getattr(self.lib, name)(*args)
        else:
            start = time.perf_counter()
            rc = getattr(self.lib, name)(*args)
            self._spent(name, start)
        if rc != 0:
            raise CloneUnsupported(f"{name} failed (CUresult {rc})")

    def _spent(self, name: str, start: float) -> None:
        spent = self.timings.setdefault(name, [0.0, 0])
        spent[0] += time.perf_counter() - start
        spent[1] += 1

    def packed_layout(self, p: _KernelNodeParams, size: int) -> KernelLayout:
        """The layout of a `size`-byte packed argument buffer of `p`'s kernel (`extra`): its
        arguments that fit, or, without parameter info, every aligned word as an argument."""
        key = (p.func or 0, p.kern or 0, size)
        if key not in self.packed:
            try:
                self.packed[key] = self.kernel_layout(p).within(size)
            except CloneUnsupported:
                self.packed[key] = KernelLayout(tuple((off, 8) for off in range(0, size - 7, 8)))
        return self.packed[key]

    def kernel_layout(self, p: _KernelNodeParams) -> KernelLayout:
        key = (p.func or 0, p.kern or 0)
        if key not in self.layouts:
            start = time.perf_counter()
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
            self.layouts[key] = KernelLayout(tuple(found))
            if self.timings is not None:
                self._spent("parameter info of a kernel (all calls)", start)
        return self.layouts[key]


def graph_nodes(driver: Driver, graph: ctypes.c_void_p) -> list[ctypes.c_void_p]:
    count = ctypes.c_size_t()
    driver.call("cuGraphGetNodes", graph, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    driver.call("cuGraphGetNodes", graph, nodes, ctypes.byref(count))
    return [ctypes.c_void_p(n) for n in nodes[:count.value]]


def kernel_arguments(driver: Driver, node: ctypes.c_void_p):
    """A kernel node's parameters, its arguments' layout and their packed bytes (read once:
    given as an array of pointers to each argument, or as one packed buffer, `extra`, as
    cuBLAS launches)."""
    p = _KernelNodeParams()
    driver.call("cuGraphKernelNodeGetParams_v2", node, ctypes.byref(p))
    if p.extra:
        address, size = extra_buffer(p.extra)
        layout = driver.packed_layout(p, size)
    else:
        layout = driver.kernel_layout(p)
    if not layout.word_offsets.size:  # (nothing in it could be an address: not read)
        return p, layout, b""
    data = (ctypes.string_at(address, size) if p.extra
            else layout.read(p.kernel_params))
    return p, layout, data


def kernel_node_words(driver: Driver, node: ctypes.c_void_p) -> np.ndarray:
    """The words of a kernel node's arguments that may hold an address (uint64), as the
    clone reads them (benchmarks compare two graphs' with it)."""
    _, layout, data = kernel_arguments(driver, node)
    return layout.values(data) if data else np.zeros(0, dtype=np.uint64)


def extra_buffer(extra: int) -> tuple[int, int]:
    """(address, bytes) of the packed argument buffer of a launch's `extra` array: pairs of
    CU_LAUNCH_PARAM_BUFFER_POINTER (1) or CU_LAUNCH_PARAM_BUFFER_SIZE (2, a pointer to a
    size_t) and a value, ended by CU_LAUNCH_PARAM_END (0)."""
    address = size = None
    for at in range(extra, extra + 128, 16):  # up to 8 pairs (two and the end, in practice)
        key = ctypes.c_void_p.from_address(at).value or 0
        if key == _PARAM_END:
            break
        value = ctypes.c_void_p.from_address(at + 8).value
        if key == _PARAM_BUFFER_POINTER:
            address = value
        elif key == _PARAM_BUFFER_SIZE:
            size = ctypes.c_size_t.from_address(value).value
        else:
            raise CloneUnsupported(f"a kernel launch's `extra` holds key {key}")
    if not address or size is None:
        raise CloneUnsupported("a kernel launch's `extra` has no argument buffer")
    return address, size


def extra_array(packed: bytearray):
    """An `extra` array naming `packed` as the argument buffer (what `extra_buffer` reads),
    and the objects it points into (to be kept alive with it)."""
    buf = (ctypes.c_char * len(packed)).from_buffer(packed)
    size = ctypes.c_size_t(len(packed))
    extra = (ctypes.c_void_p * 5)(_PARAM_BUFFER_POINTER, ctypes.addressof(buf), _PARAM_BUFFER_SIZE,
                                  ctypes.addressof(size), _PARAM_END)
    return extra, (buf, size)


__all__ = ["NODE_EMPTY", "NODE_EVENT_RECORD", "NODE_KERNEL", "NODE_MEMCPY", "NODE_MEMSET", "NODE_WAIT_EVENT",
           "CloneUnsupported", "Driver", "KernelLayout", "argument_words", "extra_array", "extra_buffer",
           "graph_nodes", "kernel_arguments", "kernel_node_words", "word_values"]
