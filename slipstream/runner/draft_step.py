"""The step of an engine whose drafter runs on the device after every step (EAGLE-3, a draft
model: runner/device_drafter.py): every batch runs here (`ModelRunner.launch`), eager.

It is the verification step of runner/speculative.py (upload, forward, the plain draw,
`verify`, download on the runner's three streams) with the drafter's two additions: the
target's forward runs inside the drafter's `capture` (EAGLE-3 reads three of its hidden
states), and after verification the drafter extends over the step's tokens and drafts the
next step's tokens on the device, so neither loop waits for the host to draft.  Under
asynchronous scheduling a verifying row's buffered drafts are placed in its draft slots by
`prepare_device_drafts` (runner/spec_device.py), with their q.

A decode-only batch takes the padded step of runner/draft_graphs.py instead: the same work
with static inputs, one CUDA graph replay a step.  The others run here, eager: the drafter
must see every token the target computes, prefill chunks included.
"""
from __future__ import annotations

from slipstream.runner.device_drafter import DraftStepInputs
from slipstream.runner.draft_graphs import launch_drafting_padded, padded_drafting_shape
from slipstream.runner.inputs import fill_inputs
from slipstream.runner.prompt_logprobs import step_prompt_spans
from slipstream.runner.spec_device import prepare_device_drafts
from slipstream.runner.speculative import (download_verified, spec_buffers, stack_draft_probs, suppress_tokens,
                                           upload_verify_inputs, verify)


def launch_device_drafting(runner, batch, launched_cls):
    """`ModelRunner.launch` for such an engine's batch (batch.spec is always set)."""
    drafter = runner.drafter
    slot = runner.slots[batch.batch_id % 2]
    slot.h2d_done.synchronize()
    padded = padded_drafting_shape(runner, batch, slot)
    if padded is not None:
        return launch_drafting_padded(runner, batch, slot, padded, launched_cls)
    shape = fill_inputs(batch, slot.host, runner.block_size, None, runner.max_model_len)
    spans = step_prompt_spans(batch, slot.host.query_start_loc)
    S, spec = len(batch.sampled), batch.spec
    bufs = spec_buffers(runner, slot.index, spec.k)
    device_drafting = spec.draft_tokens is None
    launched = launched_cls(batch, slot, S, shape.flags.num_logprobs)
    s, dev = runner.streams, runner.device
    with s.uploading(slot):
        slot.upload(batch.num_seqs)
        verify_in, uploaded, dd_in = upload_verify_inputs(batch, slot, dev)
        draft_in = DraftStepInputs.upload(batch, slot.host, spec.num_drafts, dev)
        uploaded = uploaded + draft_in.tensors()
        catch_up = drafter.upload_catch_up(batch, dev)
        if catch_up is not None:
            uploaded = uploaded + catch_up.tensors()
    with s.computing(slot, uploaded):
        for row, prompt, outputs in batch.penalty_resets:
            runner.penalties.reset_row(row, prompt, outputs)
        # (an all-greedy step's acceptance takes no q, and its drafter writes none)
        draft_probs = stack_draft_probs(spec.draft_probs, spec.k, s) if spec.draft_probs and not shape.greedy else None
        if device_drafting:
            prev = spec_buffers(runner, 1 - slot.index, spec.k)
            verify_in += prepare_device_drafts(runner, slot, shape, spec, dd_in, prev.num_emitted)
            if not shape.greedy:
                draft_probs = drafter.probs.index_select(0, dd_in.verify_table_rows)
        with drafter.capture() as aux:
            hidden = runner.forward_hidden(slot, shape)
        launched.prompt_logprobs = runner.prompt_logprobs(hidden, spans) if spans else None
        logits = runner.logits(slot, shape, hidden)
        suppress_tokens(batch, logits, dev)
        runner.sample(slot, shape, logits)
        verify(runner, slot, shape, hidden, bufs, S, *verify_in, draft_probs=draft_probs,
               synthetic_accept=spec.bench_synthetic_accept)
        # the next step's drafts, made now, on the device
        drafter.after_step(slot, shape, bufs.tokens[:S], bufs.num_emitted[:S], draft_in, aux, catch_up)
    download_verified(runner, slot, launched, bufs, S)
    return launched
