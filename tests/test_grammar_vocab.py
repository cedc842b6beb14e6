"""GrammarVocab: the grammar library knows the tokenizer's ids only, the sampler's bitmask is as
wide as the logits. Its rows must equal what xgrammar writes when it is given the whole padded
width itself (the reference: every padded id an empty token, 20x slower), state by state along
random walks of the bench schema, with the stop id inside the tokenizer and past it."""
from __future__ import annotations

import json
import os

import pytest
import torch

from slipstream.bench.workloads import BENCH_SCHEMA
from slipstream.sampling.grammar.bitmask import allocate_bitmask, allowed_token_ids
from slipstream.sampling.grammar.vocab import GrammarVocab

VOCAB = 49152 + 100  # SmolLM2's tokenizer under wider logits


def test_layouts():
    inside = GrammarVocab.of([2], 49152, VOCAB, 2)
    assert (inside.size, inside.stops, inside.past, inside.stand_in) == (49152, (2,), (), None)
    assert not inside.direct and GrammarVocab.of([2], 49152, 49152, 2).direct
    past = GrammarVocab.of([VOCAB - 5], 49152, VOCAB, 0)
    assert (past.stops, past.past, past.stand_in) == ((0,), (VOCAB - 5,), 0)
    assert [past.library_token(t) for t in (7, 0, VOCAB - 5, VOCAB - 4, 49152)] == [7, None, 0, None, None]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        GrammarVocab.of([VOCAB], 49152, VOCAB, 0)
    with pytest.raises(ValueError, match="no EOS token"):
        GrammarVocab.of([VOCAB - 1], 49152, VOCAB, None)


def test_widen_sets_past_stops_where_the_library_stop_is_allowed():
    vocab = GrammarVocab.of([VOCAB - 1, VOCAB - 40], 49152, VOCAB, 31)  # the stand-in on bit 31
    narrow = torch.zeros((2, vocab.words), dtype=torch.int32)
    narrow[0, 0] = -1                      # row 0 allows ids 0..31, the stand-in among them
    narrow[1, 3] = 5                       # row 1: ids 96 and 98, no stop
    bitmask = torch.full((4, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    vocab.widen(narrow, bitmask, [3, 1])
    assert allowed_token_ids(bitmask, 3, VOCAB).tolist() == list(range(31)) + [VOCAB - 40, VOCAB - 1]
    assert allowed_token_ids(bitmask, 1, VOCAB).tolist() == [96, 98]
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()  # other rows untouched


def _reference_backend(tok, vocab_size: int, stop: int):
    """xgrammar over the full padded width: every id past the tokenizer an empty token."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[stop])
    special = set(tok.all_special_ids)
    encoded = [""] * vocab_size
    for token, token_id in tok.get_vocab().items():
        if token_id not in special:
            encoded[token_id] = token
    info = xgr.TokenizerInfo(encoded, info.vocab_type, vocab_size=vocab_size, stop_token_ids=[stop],
                             add_prefix_space=info.add_prefix_space)
    return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(BENCH_SCHEMA))


@pytest.mark.slow  # two compiles of the schema over SmolLM2's vocabulary
@pytest.mark.parametrize("stop", ["inside", "past"])
def test_xgrammar_rows_equal_the_padded_reference(stop):
    import xgrammar as xgr

    from slipstream.sampling.grammar.backend import create_grammar_backend
    from slipstream.sampling.structured import GrammarKey
    from slipstream.model.tokenizer import load_tokenizer
    tok = load_tokenizer(os.environ.get("SLIPSTREAM_TEST_TOKENIZER")).hf
    stop_id = tok.eos_token_id if stop == "inside" else VOCAB - 3
    backend = create_grammar_backend("xgrammar", tok, VOCAB, [stop_id], batch_threads=1)
    assert backend.grammar_vocab.size == len(tok.get_vocab())
    compiled = backend.compile(GrammarKey("json", json.dumps(BENCH_SCHEMA), False))
    reference = _reference_backend(tok, VOCAB, stop_id)
    gen = torch.Generator().manual_seed(0)
    for walk in range(3):
        ours, ref = backend.new_matcher(compiled), xgr.GrammarMatcher(reference)
        for _ in range(40):
            got = allocate_bitmask(2, VOCAB)
            got.fill_(-1)
            backend.fill_bitmasks([ours], got, [1])
            want = allocate_bitmask(1, VOCAB)
            ref.fill_next_token_bitmask(want, 0)
            assert torch.equal(got[1], want[0])
            allowed = allowed_token_ids(want, 0, VOCAB)
            # lean towards the stop token where it is allowed, so walks end now and then
            token = stop_id if stop_id in allowed.tolist() and walk == 2 else \
                int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
            assert ours.accept_token(token) and ref.accept_token(token)
            assert ours.is_terminated() == ref.is_terminated()
            if ref.is_terminated():
                break
