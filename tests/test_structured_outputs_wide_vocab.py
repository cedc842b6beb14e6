"""Structured outputs on a model whose logits are wider than its tokenizer, with a stop id past
the tokenizer (Qwen's 151936 logits over 151665 tokens; a bench's Qwen shape over SmolLM2's
tokenizer): the llguidance backend's stop ids (llguidance_vocab.py, GrammarVocab's layout), its
bitmask rows against the grammar's completeness, and the engine end to end with each backend, in process and
with a grammar worker (xgrammar is the control).

The tiny model (SmolLM2's tokenizer, 64 padded logits) prefers the padded stop id STOP over every
other token by far, so an output ends with STOP exactly where the grammar first allows it: a
row that allowed it too early would end in invalid JSON, one that never allowed it would run
to max_tokens."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch
from helpers import drain_core

from slipstream import LLM, SamplingParams, StructuredOutputsParams
from slipstream.config import EngineConfig
from slipstream.core.engine_core import EngineCore
from slipstream.core.messages import AddRequest
from slipstream.sampling.grammar.backend import create_grammar_backend
from slipstream.sampling.grammar.bitmask import allocate_bitmask, allowed_token_ids
from slipstream.sampling.grammar.matcher import GrammarMatcher, fill_bitmasks

pytestmark = pytest.mark.slow  # SmolLM2's tokenizer in each backend: seconds on the 2-core machine

TOKENIZER_VOCAB = 49152
VOCAB = TOKENIZER_VOCAB + 64
STOP = TOKENIZER_VOCAB + 31  # bit 31 of its bitmask word: the int32's sign bit
EOS = 2  # the tokenizer's own EOS, <|im_end|>
COMMON = {"device": "cpu", "max_model_len": 256}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4},
    "kind": {"enum": ["cat", "dog"]},
    "ok": {"type": "boolean"}}, "required": ["name", "kind", "ok"]}


@pytest.fixture(scope="module")
def tokenizer():
    from slipstream.model.tokenizer import load_tokenizer
    tok = load_tokenizer(os.environ.get("SLIPSTREAM_TEST_TOKENIZER"))
    assert len(tok.hf) == TOKENIZER_VOCAB and tok.hf.eos_token_id == EOS
    return tok


def test_llguidance_eos_ids_and_bad_stop_ids(tokenizer):
    """llguidance's EOS ids: the stop ids inside the tokenizer, else the tokenizer's EOS
    standing in; ids it cannot take are one-line errors."""
    for stops, eos, stand_in in (([EOS, STOP], [EOS], None), ([STOP], [EOS], EOS), ([7, EOS], [EOS, 7], None)):
        backend = create_grammar_backend("llguidance", tokenizer.hf, VOCAB, stops)
        assert sorted(backend.tokenizer.eos_tokens) == sorted(eos), stops
        assert backend.grammar_vocab.stand_in == stand_in and backend.stop_token_ids == tuple(sorted(stops))
    with pytest.raises(ValueError, match=r"^the model's vocabulary \(100\) is narrower than its tokenizer's"):
        create_grammar_backend("llguidance", tokenizer.hf, 100, [EOS])
    with pytest.raises(ValueError, match=r"^stop token id 49216 is outside the model's vocabulary \(0..49215\)$"):
        create_grammar_backend("llguidance", tokenizer.hf, VOCAB, [EOS, VOCAB])
    with pytest.raises(ValueError, match="^a grammar backend needs the model's stop token ids"):
        create_grammar_backend("llguidance", tokenizer.hf, VOCAB, [])


@pytest.mark.parametrize("stops", [[EOS, STOP], [STOP]], ids=["eos-and-past", "past-only"])
def test_llguidance_rows_allow_a_past_stop_id_where_the_grammar_is_complete(tokenizer, stops):
    backend = create_grammar_backend("llguidance", tokenizer.hf, VOCAB, stops)
    assert backend.stop_token_ids == tuple(sorted(stops))
    compiled = backend.compile(("json", json.dumps(PERSON), True))
    text = json.dumps({"name": "ab", "kind": "cat", "ok": True})
    ids = tokenizer.encode(text, add_special_tokens=False)
    walked = []  # one matcher per prefix: rows filled in one batch call and one by one
    for n in range(len(ids) + 1):
        m = GrammarMatcher(backend, compiled)
        assert m.accept_many(ids[:n]) == n
        walked.append(m)
    rows = list(range(len(walked)))
    batch, single = allocate_bitmask(len(rows), VOCAB), allocate_bitmask(len(rows), VOCAB)
    fill_bitmasks(walked, batch, rows)
    for row, m in enumerate(walked):
        m.fill_bitmask(single, row)
    assert torch.equal(batch, single)
    for row, m in enumerate(walked):
        allowed = set(allowed_token_ids(batch, row, VOCAB).tolist())
        assert (STOP in allowed) == m.accepts_eos == (row == len(ids))
        assert (EOS in allowed) == (EOS in stops and m.accepts_eos)  # a stand-in is never allowed
        assert not {t for t in allowed if t >= TOKENIZER_VOCAB} - {STOP}  # the padding never
    done = walked[-1]
    assert allowed_token_ids(batch, len(ids), VOCAB).tolist() == sorted(stops)
    if stops == [STOP]:
        assert not done.accept(EOS)  # the stand-in is no stop token
    assert not walked[1].accept(STOP)  # incomplete: refused, state unchanged
    assert done.accept(STOP) and done.is_terminated
    done.rollback(1)
    assert not done.is_terminated and done.accepts_eos
    assert done.accept(STOP) and done.is_terminated


def make_wide_model(folder: str, tokenizer, with_tokenizer: bool) -> str:
    """A tiny random Llama over SmolLM2's tokenizer with 64 padded logits and STOP as its EOS
    (config and generation_config), whose every hidden state leans on one dimension that only
    STOP's logit reads: STOP comes first wherever it is allowed. `with_tokenizer`: the
    tokenizer saved with it (its stop ids are then STOP and the tokenizer's EOS)."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=STOP, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 8.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[STOP] = 0.0
        model.lm_head.weight[STOP, 0] = 2.0
    model.save_pretrained(folder)
    if with_tokenizer:
        tokenizer.hf.save_pretrained(folder)
    return folder


def assert_valid_and_stopped(tokenizer, token_ids, finish_reason) -> None:
    assert finish_reason == "stop" and token_ids[-1] == STOP, (finish_reason, token_ids)
    assert max(token_ids[:-1]) < TOKENIZER_VOCAB
    jsonschema.validate(json.loads(tokenizer.decode(token_ids[:-1])), PERSON)


def constrained_params() -> list[SamplingParams]:
    constraint = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    return [SamplingParams(max_tokens=60, temperature=t, seed=s, structured_outputs=constraint)
            for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tokenizer):
    return make_wide_model(str(tmp_path_factory.mktemp("wide")), tokenizer, with_tokenizer=True)


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "1-worker"])
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_json_through_the_engine_ends_on_the_past_stop_id(wide_model, tokenizer, backend, workers):
    llm = LLM(wide_model, structured_outputs_backend=backend, structured_outputs_workers=workers, **COMMON)
    try:
        assert llm.engine.eos_token_ids == {EOS, STOP}
        params = constrained_params()
        free = SamplingParams(max_tokens=5, temperature=0.0)  # the model's own choice: STOP at once
        outs = llm.generate(["A pet:", "Pet record:", "Go", "JSON please", "Free"], params + [free])
        for o in outs[:-1]:
            assert_valid_and_stopped(tokenizer, o.outputs[0].token_ids, o.outputs[0].finish_reason)
        assert outs[-1].outputs[0].token_ids == [STOP] and outs[-1].outputs[0].finish_reason == "stop"
        assert llm.engine.stats()["grammar_compile_failed"] == 0
    finally:
        llm.engine.close()


@pytest.mark.parametrize("backend, workers", [("llguidance", 0), ("llguidance", 1), ("xgrammar", 0)])
def test_only_a_past_stop_id_with_a_grammar_tokenizer(tmp_path, tokenizer, backend, workers):
    """The bench's shape: a model folder without a tokenizer, whose only stop id is past the
    tokenizer structured outputs read (`grammar_tokenizer`, as `--grammar-tokenizer`)."""
    folder = make_wide_model(str(tmp_path), tokenizer, with_tokenizer=False)
    config = EngineConfig(model=folder, structured_outputs_backend=backend,
                          structured_outputs_workers=workers, **COMMON)
    core = EngineCore(config, grammar_tokenizer=tokenizer.hf)
    try:
        assert core.eos_token_ids == {STOP}
        for i, p in enumerate(constrained_params()):
            core.add(AddRequest(f"r{i}", [5 + i, 6, 7], p.to_dict()))
        ends, tokens = drain_core(core)
        assert len(ends) == 4
        for rid, (reason, error) in ends.items():
            assert error is None, error
            assert_valid_and_stopped(tokenizer, tokens[rid], reason)
    finally:
        core.close()
