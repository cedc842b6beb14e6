"""The batch-row schema shared by `generate --input` and `generate --ray --input`
(`slipstream.frontend.batch_rows`), without a model: the same JSONL file parses to the same
requests through the local reader and through the Ray replica's (Ray Data's pyarrow reader,
nulls where a row lacks a column), flat and nested sampling fields are one thing, a field
given both ways or an unknown key fails naming it, and the Ray path's one-output-per-row rule."""
from __future__ import annotations

import json

import pytest


def write_jsonl(path, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


SHARED_ROWS = [
    {"id": "flat", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5, "seed": 3},
    {"id": "nested", "prompt": "Hello", "sampling_params": {"max_tokens": 5, "temperature": 0.5, "seed": 3}},
    {"id": "mixed", "prompt": "Hello", "seed": 3, "sampling_params": {"max_tokens": 5, "temperature": 0.5}},
    {"id": "ids", "prompt_token_ids": [1, 2, 3], "sampling_params": {"stop": ["."]}},
    {"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"mood": "sad"},
     "add_generation_prompt": True},
    {"id": "cont", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}],
     "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}},
    {"prompt": "no id: its line number", "sampling_params": None, "messages": None},
]
CLI_DEFAULTS = dict(max_tokens=9, temperature=0.0, top_p=1.0, seed=None, stop=None, ignore_eos=False)


def ray_requests(path, defaults):
    """What `EngineReplica` parses from a JSONL file that Ray Data reads (pyarrow's reader,
    columns a row lacks filled with nulls)."""
    pj = pytest.importorskip("pyarrow.json")  # comes with the extra slipstream[ray]
    from slipstream.ray.rows import parse_ray_row, request_columns

    return [parse_ray_row(row, defaults) for row in request_columns(pj.read_json(path))]


@pytest.mark.parametrize("chat", [False, True])
def test_the_same_file_gives_the_same_requests_with_and_without_ray(tmp_path, chat):
    from slipstream.cli.batch_job import read_jsonl
    from slipstream.frontend.batch_rows import RowDefaults
    from slipstream.model.tokenizer import ChatOptions

    src = tmp_path / "in.jsonl"
    write_jsonl(src, SHARED_ROWS)
    chat_defaults = ChatOptions(template_kwargs={"mood": "calm"}, template="T")
    local = read_jsonl(str(src), CLI_DEFAULTS, chat, chat_defaults)
    assert [j.error for j in local] == [None] * len(SHARED_ROWS)
    assert [j.id for j in local] == [r.get("id", "7") for r in SHARED_ROWS]
    through_ray = ray_requests(str(src), RowDefaults(CLI_DEFAULTS, chat_defaults, chat))
    assert [j.row for j in local] == through_ray
    by_id = {j.id: j.row for j in local}
    assert by_id["flat"].params == by_id["nested"].params == by_id["mixed"].params
    assert by_id["flat"].params.max_tokens == 5 and by_id["ids"].params.max_tokens == 9
    assert by_id["chat"].chat.template_kwargs == {"mood": "sad"} and by_id["chat"].chat.template == "T"
    assert by_id["cont"].chat.template_kwargs == {"mood": "calm", "x": 1}
    assert by_id["cont"].chat.continue_final_message and not by_id["cont"].chat.add_generation_prompt
    assert by_id["7"].is_chat == chat  # --chat: a text prompt is one user message
    if chat:
        assert by_id["7"].prompt == [{"role": "user", "content": "no id: its line number"}]


def test_row_errors_name_the_field():
    from slipstream.frontend.batch_rows import RowDefaults, parse_row

    cases = [({"prompt": "x", "top_k": 2, "sampling_params": {"top_k": 3}},
              "top_k is given both at the top level and in sampling_params; give it once"),
             ({"prompt": "x", "tag": "a"}, "unknown key 'tag'"),
             ({"prompt": [1, 2]}, "prompt must be a string (token ids go in prompt_token_ids)"),
             ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of"),
             ({}, "exactly one of"),
             ({"prompt": "x", "sampling_params": "hot"}, "sampling_params must be an object, got str"),
             ({"prompt": "x", "add_generation_prompt": False}, "apply to chats only"),
             ({"messages": [{"role": "user", "content": "y"}], "chat_template_kwargs": [1]},
              "chat_template_kwargs must be an object"),
             ({"messages": [{"role": "user", "content": "y"}], "continue_final_message": "yes"},
              "continue_final_message must be true or false")]
    for row, message in cases:
        with pytest.raises(ValueError) as e:
            parse_row(row, RowDefaults())
        assert message in str(e.value) and "\n" not in str(e.value), (row, e.value)
    # a null counts as not given: no conflict, the default stays
    row = parse_row({"prompt": "x", "top_k": None, "sampling_params": {"top_k": 4}}, RowDefaults({"top_k": 2}))
    assert row.params.top_k == 4


def test_ray_rows_are_one_output_each():
    from slipstream.frontend.batch_rows import RowDefaults
    from slipstream.ray.rows import check_defaults, parse_ray_row

    for bad, word in (({"n": 2}, "n must be 1"), ({"logprobs": 1}, "logprobs is not written"),
                      ({"prompt_logprobs": 0}, "prompt_logprobs is not written")):
        with pytest.raises(ValueError, match=word):
            parse_ray_row({"prompt": "x", "sampling_params": bad}, RowDefaults())
        with pytest.raises(ValueError, match=word):
            check_defaults(bad)
