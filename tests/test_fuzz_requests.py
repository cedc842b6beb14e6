"""Hypothesis over what a client can send the front door, bounded and reproducible (a fixed
budget, derandomized): SamplingParams fields, prompts (token ids of any size, text with lone
surrogates) and JSONL lines. The property: a bad value is a one-line error of its own request
(a ValueError / TypeError naming the field); a good one is something the engine can store and
send (the core's message encodes, the request table's row fits); in a batch job the good
requests' outputs equal a clean run."""
from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from fake_async_llm import FakeTokenizer  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from slipstream.cli.batch_job import parse_line, run_job  # noqa: E402
from slipstream.core.messages import AddRequest, CoreInfo, encoder  # noqa: E402
from slipstream.frontend.batch_rows import RowDefaults  # noqa: E402
from slipstream.frontend.prompts import ValidatedRequest, validate_request  # noqa: E402
from slipstream.sampling.params import SamplingParams  # noqa: E402
from slipstream.sched.request import Request  # noqa: E402
from slipstream.sched.request_table import RequestTable  # noqa: E402

FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
INFO = CoreInfo(model_name="m", max_model_len=64, vocab_size=259, eos_token_ids=[2], num_kv_blocks=8,
                block_size=16, device="cpu", async_scheduling=False, max_num_batched_tokens=64)

# integers around every bound an engine stores (int32, int64, uint64) and far past them
HOSTILE_INTS = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**31) - 1, -(2**63),
                     -(2**63) - 1, -(2**70), 3_000_000_000]),
    st.integers())
TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)  # surrogates included
VALUES = st.one_of(st.none(), st.booleans(), HOSTILE_INTS,
                   st.floats(allow_nan=True, allow_infinity=True), TEXT,
                   st.lists(HOSTILE_INTS, max_size=3), st.lists(TEXT, max_size=3))
FIELDS = SamplingParams.field_names()


def one_line_naming_a_field(error: Exception) -> None:
    message = str(error)
    assert message and "\n" not in message, message
    assert message.split(" ", 1)[0] in FIELDS or message.startswith(("unknown", "structured")), message


@FUZZ
@given(st.dictionaries(st.sampled_from([f for f in FIELDS if f != "structured_outputs"]), VALUES, max_size=5))
def test_sampling_params_are_refused_naming_the_field_or_fit_the_engine(fields):
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        one_line_naming_a_field(e)
        return
    # what the engine does with an accepted one: send it to the core, store its row
    seed = params.seed % (1 << 63) if params.seed is not None else 0
    encoder.encode(AddRequest("r", [1, 2], params.to_dict(), seed))
    RequestTable.row_values(Request("r", [1, 2], params, seed, frozenset({2})))


PROMPTS = st.one_of(TEXT, st.lists(HOSTILE_INTS, max_size=6), st.lists(VALUES, max_size=3), VALUES)


@FUZZ
@given(PROMPTS)
def test_a_prompt_is_a_one_line_error_or_ids_inside_the_vocabulary(prompt):
    try:
        request = validate_request(prompt, None, FakeTokenizer(), INFO)
    except (TypeError, ValueError) as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(request, ValidatedRequest)
    assert all(0 <= t < INFO.vocab_size for t in request.prompt_token_ids)


# -- JSONL lines through a real engine (dummy weights, token-id prompts) ---------------------------
GOOD_LINES = [{"id": f"good{i}", "prompt_token_ids": [1, 10 + i, 20, 30], "max_tokens": 3, "temperature": 0,
               "ignore_eos": True} for i in range(3)]
# (not n or max_tokens: a good value of either only makes a line cost more to run)
LINE_KEYS = st.sampled_from(["id", "prompt", "prompt_token_ids", "messages", "sampling_params", "top_k",
                             "seed", "stop_token_ids", "logprobs", "temperature", "min_p", "bogus"])


@pytest.fixture(scope="module")
def dummy_llm(tiny_model):
    from slipstream import LLM
    folder, _ = tiny_model("llama")  # (a tiny Llama's config; its weights: dummy)
    llm = LLM(folder, load_format="dummy", device="cpu", max_model_len=64, max_num_seqs=8, batch_invariant=True)
    yield llm
    llm.shutdown()


def _run(llm, lines: list[bytes]) -> dict[str, dict]:
    defaults = RowDefaults({"max_tokens": 2})
    jobs = [parse_line(raw, n, defaults) for n, raw in enumerate(lines, 1)]
    rows: dict[str, dict] = {}
    counts = run_job(llm, jobs, lambda row: rows.setdefault(row["id"], row))
    assert counts.not_run == 0 and counts.ok + counts.failed == len(rows)
    return rows


@pytest.mark.slow
def test_bad_jsonl_lines_fail_alone_and_good_ones_equal_a_clean_run(dummy_llm):
    clean = _run(dummy_llm, [json.dumps(r).encode() for r in GOOD_LINES])
    assert all(r["finish_reason"] == "length" for r in clean.values())

    @settings(max_examples=15, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(st.dictionaries(LINE_KEYS, VALUES, max_size=4).map(lambda d: json.dumps(d).encode()),
                              st.binary(max_size=12)), min_size=1, max_size=4))
    def check(bad_lines):
        bad_lines = [b if b.strip() else b"{" for b in bad_lines]
        lines = [json.dumps(GOOD_LINES[0]).encode(), *bad_lines, *(json.dumps(r).encode() for r in GOOD_LINES[1:])]
        rows = _run(dummy_llm, lines)
        for rid, row in clean.items():
            assert rows[rid]["generated_tokens"] == row["generated_tokens"], rid
        for rid, row in rows.items():
            if row["error"]:
                assert "\n" not in row["error"]
        assert dummy_llm.dead_error is None

    check()
