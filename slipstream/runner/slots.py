"""IO slots: the pinned host inputs of one batch, their device copies, and its outputs.

Two slots alternate between batches, so the CPU fills batch N+1's inputs while the GPU
still reads batch N's.  All inputs share one int32 buffer (the float inputs are float32
views of its middle, the block table comes last), so a step's upload is one copy of its
used prefix.  Device views have fixed addresses: CUDA graphs captured for a slot read and
write exactly these (runner/graphs.py).

Tensor parallelism: the engine core fills a host-only slot (`host_only`), `pack` copies
out the parts a step reads (its tokens, rows and sampling rows, the block table's used
columns) as two flat arrays, and each rank's runner `unpack`s them into its own slot.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from slipstream.sampling.columns import ALL_COLUMNS, int32_words

MAX_LOGPROBS = 20
# int inputs with one entry per token, per sequence row (query_start_loc has one more);
# the others have int32_words entries per sampling row
_PER_TOKEN = ("input_ids", "positions", "slot_mapping", "carry_idx")
_PER_ROW = ("seq_lens", "decode_order")


class IOSlot:
    def __init__(self, index: int, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device, streams, host_only: bool = False) -> None:
        self.index = index
        self.max_blocks = max_blocks
        pin = device.type == "cuda" and not host_only
        T, S = max_tokens, max_seqs
        # the sampling columns come from their table (sampling_columns.py); floats, then the
        # block table last
        ints = [("input_ids", T), ("positions", T), ("slot_mapping", T), ("carry_idx", T),
                ("query_start_loc", S + 1), ("seq_lens", S), ("decode_order", S), ("logits_indices", S),
                ("token_index", S), ("state_row", S)]
        ints += [(c.name, int32_words(c) * S) for c in ALL_COLUMNS if c.dtype != np.float32]
        floats = [(c.name, S) for c in ALL_COLUMNS if c.dtype == np.float32]
        self._int_offsets, off = _layout(ints, 0)
        self._float_offsets, off = _layout(floats, off)
        self._int_offsets["block_table"] = (off, S * max_blocks)
        self.block_table_offset = off
        self.host_int = torch.zeros(off + S * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.host_float = self.host_int.view(torch.float32)  # (the same buffer)
        if not host_only:
            self.dev_int = torch.zeros(self.host_int.numel(), dtype=torch.int32, device=device)
            self.dev_float = self.dev_int.view(torch.float32)
        # numpy views of the host side (the CPU writes these), torch views of the device side
        self.host = SimpleNamespace(**self._views(self.host_int.numpy(), self.host_float.numpy(), np))
        # (offset, what its length counts, words per entry) of every int input a step sends
        # (not the block table: it is sent as the used rows and columns)
        words = {c.name: int32_words(c) for c in ALL_COLUMNS}
        self._int_fields = [(off, "token" if n in _PER_TOKEN else "row" if n in _PER_ROW else
                             "qsl" if n == "query_start_loc" else "sample", words.get(n, 1))
                            for n, (off, _) in self._int_offsets.items() if n != "block_table"]
        self._float_starts = [off for off, _ in self._float_offsets.values()]
        if host_only:
            return
        self.dev = SimpleNamespace(**self._views(self.dev_int, self.dev_float, torch))
        # outputs
        self.dev.tokens = torch.zeros(S, dtype=torch.int32, device=device)
        self.dev.logprobs = torch.zeros(S, 1 + MAX_LOGPROBS, dtype=torch.float32, device=device)
        self.dev.logprob_ids = torch.zeros(S, MAX_LOGPROBS, dtype=torch.int32, device=device)
        self.host.tokens = torch.zeros(S, dtype=torch.int32, pin_memory=pin)
        self.host.logprobs = torch.zeros(S, 1 + MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin)
        self.host.logprob_ids = torch.zeros(S, MAX_LOGPROBS, dtype=torch.int32, pin_memory=pin)
        self.h2d_start, self.h2d_done = streams.event(), streams.event()
        self.compute_start, self.compute_done = streams.event(), streams.event()
        self.d2h_start, self.d2h_done = streams.event(), streams.event()
        self.mask_done = streams.event()  # the token bitmask's upload (structured outputs)
        self._pin, self._device, self._max_seqs = pin, device, S
        self._bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
        # the hidden states of a constrained step's sampled rows, between its forward and its
        # sampling (ModelRunner.finish_launch): [max_seqs, hidden], allocated with the bitmask
        self.sample_hidden: torch.Tensor | None = None

    def token_bitmask(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pinned host, device) int32 [max_seqs, ceil(vocab_size / 32)] token bitmasks of the
        sampling rows, allocated at the first batch with structured outputs (fixed addresses)."""
        if self._bitmask is None:
            words = (vocab_size + 31) // 32
            host = torch.full((self._max_seqs, words), -1, dtype=torch.int32, pin_memory=self._pin)
            self._bitmask = host, torch.full_like(host, -1, device=self._device)
        return self._bitmask

    def deferred_sampling_buffers(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Allocate what a constrained step keeps between its forward and its sampling: the
        token bitmasks and `sample_hidden` (fixed addresses, for CUDA graphs)."""
        self.token_bitmask(vocab_size)
        if self.sample_hidden is None:
            self.sample_hidden = torch.zeros(self._max_seqs, hidden_size, dtype=dtype, device=self._device)

    def _views(self, ints, floats, lib) -> dict:
        v = {}
        for name, (off, size) in self._int_offsets.items():
            v[name] = ints[off:off + size]
        for name, (off, size) in self._float_offsets.items():
            v[name] = floats[off:off + size]
        for c in ALL_COLUMNS:
            if c.dtype == np.int64:
                v[c.name] = v[c.name].view(np.int64 if lib is np else torch.int64)
        v["block_table"] = v["block_table"].reshape(-1, self.max_blocks)
        return v

    def device_buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of every device buffer a step reads or writes, in a fixed order:
        what differs between two slots' CUDA graphs of one step (runner/graph_clone.py)."""
        d = self.dev
        buffers = [self.dev_int, d.tokens, d.logprobs, d.logprob_ids]
        if self._bitmask is not None:  # (structured outputs: from the first constrained batch)
            buffers.append(self._bitmask[1])
        if self.sample_hidden is not None:
            buffers.append(self.sample_hidden)
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in buffers]

    def upload(self, num_seqs: int) -> None:
        """Copy the inputs of a batch of `num_seqs` rows (host -> device, current stream)."""
        end = self._inputs_end(num_seqs)
        self.dev_int[:end].copy_(self.host_int[:end], non_blocking=True)

    def _inputs_end(self, num_seqs: int) -> int:
        """The int inputs of `num_seqs` rows end with their block-table rows."""
        return self.block_table_offset + num_seqs * self.max_blocks

    def download(self, num_samples: int, num_logprobs: int) -> None:
        """Copy the outputs back (device -> host, current stream)."""
        self.host.tokens[:num_samples].copy_(self.dev.tokens[:num_samples], non_blocking=True)
        if num_logprobs:
            self.host.logprobs[:num_samples].copy_(self.dev.logprobs[:num_samples], non_blocking=True)
            self.host.logprob_ids[:num_samples].copy_(self.dev.logprob_ids[:num_samples], non_blocking=True)

    # -- tensor parallelism: the step's inputs as flat arrays, and back ------------------
    def _used(self, num_tokens: int, num_seqs: int, num_samples: int) -> list[tuple[int, int]]:
        """(offset, words) of every int input a step of these (padded) sizes reads."""
        count = {"token": num_tokens, "row": num_seqs, "qsl": num_seqs + 1, "sample": num_samples}
        return [(off, count[kind] * w) for off, kind, w in self._int_fields]

    def pack(self, num_tokens: int, num_seqs: int, num_samples: int, rows: int,
             block_cols: int) -> tuple[np.ndarray, np.ndarray]:
        """The host inputs a step reads: int32 and float32 arrays (new, owned by the caller);
        the block table's first `rows` rows and `block_cols` columns."""
        ints = self.host_int.numpy()
        parts = [ints[off:off + n] for off, n in self._used(num_tokens, num_seqs, num_samples)]
        parts.append(self.host.block_table[:rows, :block_cols].ravel())
        floats = self.host_float.numpy()
        fparts = [floats[off:off + num_samples] for off in self._float_starts]
        return np.concatenate(parts), np.concatenate(fparts) if fparts else np.zeros(0, np.float32)

    def unpack(self, ints_buf, floats_buf, num_tokens: int, num_seqs: int, num_samples: int,
               rows: int, block_cols: int) -> None:
        """Write what `pack` made (on another slot of the same layout) into this slot's host side."""
        src = np.frombuffer(ints_buf, np.int32)
        ints, pos = self.host_int.numpy(), 0
        for off, n in self._used(num_tokens, num_seqs, num_samples):
            ints[off:off + n] = src[pos:pos + n]
            pos += n
        self.host.block_table[:rows, :block_cols] = src[pos:pos + rows * block_cols].reshape(rows, block_cols)
        fsrc = np.frombuffer(floats_buf, np.float32)
        floats = self.host_float.numpy()
        for i, off in enumerate(self._float_starts):
            floats[off:off + num_samples] = fsrc[i * num_samples:(i + 1) * num_samples]


def _layout(fields, off: int) -> tuple[dict[str, tuple[int, int]], int]:
    """(name -> (offset, size)) of fields laid out from word `off`, and where they end."""
    offsets = {}
    for name, size in fields:
        off += off % 2  # keep 8-byte alignment so int64 views (seed) are legal
        offsets[name] = (off, size)
        off += size
    return offsets, off
