"""Whether the buffers sized by max_num_seqs and max_num_batched_tokens fit the memory the
device has free, checked before the runner allocates any of them: a flag such as
--max-num-seqs 10000000 is a one-line error naming it, not a 20 GB allocation that fails.

The estimate counts what grows with those flags: per running row, the penalty state (a bool
and an int32 per vocabulary entry), the IO slots' block tables (two slots, host and device)
and one step's logits; per batched token, the activations of one layer (a generous
multiple of the hidden and intermediate widths, in float32). The KV cache is sized later,
from what is left (kv_memory.py)."""
from __future__ import annotations

import torch

GiB = 1 << 30


def buffer_bytes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                 vocab_size: int, hidden_size: int, intermediate_size: int) -> int:
    """Bytes of the buffers sized by the two flags (an estimate, on the generous side)."""
    max_blocks = -(-max_model_len // block_size)
    per_row = 5 * vocab_size + 2 * 2 * 4 * max_blocks + 4 * vocab_size
    per_token = 4 * (4 * hidden_size + 2 * intermediate_size)
    return (max_num_seqs + 1) * per_row + max_num_batched_tokens * per_token


def free_bytes(device: torch.device) -> int:
    """Memory free for new buffers: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_buffer_budget(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                        model_config, device: torch.device, free: int | None = None) -> None:
    """ValueError naming the flags when their buffers would not fit the free memory."""
    need = buffer_bytes(max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
                        model_config.vocab_size, model_config.hidden_size, model_config.intermediate_size)
    free = free_bytes(device) if free is None else free
    if need > free:
        raise ValueError(
            f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens} and "
            f"max_model_len={max_model_len} need about {need / GiB:.1f} GiB of buffers (sampling state over "
            f"a {model_config.vocab_size}-token vocabulary and a block table per running request, one step's "
            f"activations per batched token), but {device.type} has {free / GiB:.1f} GiB free: lower "
            f"--max-num-seqs / --max-num-batched-tokens / --max-model-len")
