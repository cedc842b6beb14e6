"""CUDA graph nodes read and written through the driver API (libcuda over ctypes), for
runner/graph_clone.py: the few driver calls it makes, each kernel's argument layout (asked of
the driver once per kernel), and a kernel node's arguments in either form a launch gives
them: an array of pointers to each argument, or one packed buffer (`extra`, as cuBLAS
launches)."""
from __future__ import annotations

import ctypes
import struct
import time
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class KernelLayout:
    """A kernel's arguments as the clone reads them, worked out once per kernel: each
    argument's (offset, size), the bytes they span, the offsets of the words that may hold
    an address, and a reader of those words from a packed buffer in one call."""
    arguments: tuple[tuple[int, int], ...]
    span: int = field(init=False)
    words: tuple[int, ...] = field(init=False)
    reader: struct.Struct = field(init=False)

    def __post_init__(self) -> None:
        words = tuple(argument_words(list(self.arguments)))
        fmt, at = "<", 0
        for w in words:
            fmt += f"{w - at}xQ" if w > at else "Q"
            at = w + 8
        object.__setattr__(self, "span", max((o + n for o, n in self.arguments), default=0))
        object.__setattr__(self, "words", words)
        object.__setattr__(self, "reader", struct.Struct(fmt))

    def within(self, size: int) -> "KernelLayout":
        """The same layout cut to a packed buffer of `size` bytes (a launch's `extra`)."""
        return self if self.span <= size else KernelLayout(tuple(a for a in self.arguments if sum(a) <= size))

    def read(self, params_address: int) -> bytes:
        """The packed arguments of a node whose parameters are `params_address`, an array of
        pointers to each argument: one read when they lie packed as the layout has them (as
        the driver keeps a node's), else one per argument."""
        pointers = [ptr or 0 for ptr in (ctypes.c_void_p * len(self.arguments)).from_address(params_address)]
        if self.arguments[0][0] == 0 and all(ptr == pointers[0] + off for ptr, (off, _) in zip(pointers, self.arguments)):
            return ctypes.string_at(pointers[0], self.span)
        packed = bytearray(self.span)
        for ptr, (off, size) in zip(pointers, self.arguments):
            packed[off:off + size] = ctypes.string_at(ptr, size)
        return bytes(packed)


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("kernel_params", ctypes.POINTER(ctypes.c_void_p)),
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
    """A kernel node's parameters, its arguments' layout, their bytes and the words of them
    that may hold an address (read once: given as an array of pointers to each argument, or
    as one packed buffer, `extra`, as cuBLAS launches)."""
    p = _KernelNodeParams()
    driver.call("cuGraphKernelNodeGetParams_v2", node, ctypes.byref(p))
    if p.extra:
        address, size = extra_buffer(p.extra)
        layout = driver.packed_layout(p, size)
    else:
        layout = driver.kernel_layout(p)
    if not layout.words:  # (nothing in it could be an address: not read)
        return p, layout, b"", ()
    data = (ctypes.string_at(address, size) if p.extra
            else layout.read(ctypes.cast(p.kernel_params, ctypes.c_void_p).value))
    return p, layout, data, layout.reader.unpack_from(data)


def kernel_node_words(driver: Driver, node: ctypes.c_void_p) -> tuple[int, ...]:
    """The words of a kernel node's arguments that may hold an address, as the clone reads
    them (benchmarks compare two graphs' with it)."""
    return kernel_arguments(driver, node)[3]


def extra_buffer(extra: int) -> tuple[int, int]:
    """(address, bytes) of the packed argument buffer of a launch's `extra` array: pairs of
    CU_LAUNCH_PARAM_BUFFER_POINTER (1) or CU_LAUNCH_PARAM_BUFFER_SIZE (2, a pointer to a
    size_t) and a value, ended by CU_LAUNCH_PARAM_END (0)."""
    words = ctypes.cast(ctypes.c_void_p(extra), ctypes.POINTER(ctypes.c_void_p))
    address = size = None
    for i in range(0, 16, 2):  # (two pairs and the end, in practice)
        key = words[i] or 0
        if key == _PARAM_END:
            break
        if key == _PARAM_BUFFER_POINTER:
            address = words[i + 1]
        elif key == _PARAM_BUFFER_SIZE:
            size = ctypes.cast(ctypes.c_void_p(words[i + 1]), ctypes.POINTER(ctypes.c_size_t))[0]
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


__all__ = ["CloneUnsupported", "Driver", "KernelLayout", "argument_words", "extra_array", "extra_buffer",
           "graph_nodes", "kernel_arguments", "kernel_node_words"]
