"""Chat template options (vLLM's add_generation_prompt, continue_final_message,
chat_template_kwargs, a template of one's own, chat echo): the tokenizer on the embedded
SmolLM2, the server's protocol on the fake engine, the flags of `serve` / `generate`, a
JSONL batch job, Ray rows, and `LLM.chat`."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fake_async_llm import FakeTokenizer, run_app
from slipstream.cli.main import main
from slipstream.cli.options import chat_defaults, read_chat_template
from slipstream.frontend.prompts import chat_token_ids, normalize_messages
from slipstream.frontend.batch_rows import RowDefaults
from slipstream.ray.rows import parse_ray_row
from slipstream.model.tokenizer import ChatOptionError, ChatOptions, load_tokenizer

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
# a template that shows its variables, so a test sees what reached it
SHOW = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
        "{% if mood is defined %}(mood={{ mood }}){% endif %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


# ---------------------------------------------------------------- the tokenizer
@pytest.mark.slow
def test_generation_prompt_off_and_continue_final_message(tok):
    plain = tok.render_chat(CHAT, ChatOptions(add_generation_prompt=False))
    assert plain.endswith("<|im_start|>assistant\nThe answer is<|im_end|>\n")
    cont = tok.render_chat(CHAT, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert cont.endswith("<|im_start|>assistant\nThe answer is") and plain.startswith(cont)
    default = tok.render_chat(CHAT)
    assert default == plain + "<|im_start|>assistant\n"


def test_template_kwargs_and_a_template_of_ones_own(tok):
    text = tok.render_chat(CHAT, ChatOptions(template=SHOW, template_kwargs={"mood": "calm"}))
    assert text == "[user]Hi\n[assistant]The answer is\n(mood=calm)[assistant]"
    ids = tok.apply_chat_template(CHAT, ChatOptions(template=SHOW))
    assert tok.decode(ids, skip_special_tokens=False) == "[user]Hi\n[assistant]The answer is\n[assistant]"


@pytest.mark.parametrize("options, param, needle", [
    (ChatOptions(continue_final_message=True), "continue_final_message", "add_generation_prompt to be false"),
    (ChatOptions(template_kwargs={"tokenize": True}), "chat_template_kwargs", "may not set tokenize"),
    (ChatOptions(template_kwargs={"messages": []}), "chat_template_kwargs", "may not set messages"),
])
def test_bad_options_name_their_field(tok, options, param, needle):
    with pytest.raises(ChatOptionError, match=needle) as e:
        tok.render_chat(CHAT, options)
    assert e.value.param == param


@pytest.mark.slow
def test_continue_needs_content_and_template_errors_are_value_errors(tok):
    empty = CHAT[:1] + [{"role": "assistant", "content": ""}]
    with pytest.raises(ChatOptionError, match="needs a last message with content"):
        tok.render_chat(empty, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    broken = "{{ raise_exception('no assistants here') }}"
    with pytest.raises(ValueError, match="the chat template rejected the messages: no assistants here"):
        tok.render_chat(CHAT, ChatOptions(template=broken))


def test_over_takes_defaults_for_what_is_not_set():
    defaults = ChatOptions(template_kwargs={"a": 1, "b": 2}, template="T")
    own = ChatOptions(False, True, {"b": 3})
    assert own.over(defaults) == ChatOptions(False, True, {"a": 1, "b": 3}, "T")
    assert ChatOptions(template="U").over(defaults).template == "U"


def test_one_normalization_of_messages():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None}, {"role": "tool", "content": "42", "name": "calc"}]
    assert normalize_messages(parts) == [{"role": "user", "content": "a\nb"},
                                         {"role": "assistant", "content": ""},
                                         {"role": "tool", "content": "42", "name": "calc"}]
    with pytest.raises(ValueError, match=r"messages\[0\].content is missing"):
        normalize_messages([{"role": "user", "content": None}])
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: only text parts"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url"}]}])


# ---------------------------------------------------------------- the server (fake engine)
def _serve(body_fn, **args):
    return run_app(lambda c, llm: body_fn(c), max_body_bytes=1 << 16, **args)


def _prompt_text(ids):
    return FakeTokenizer().decode(ids)


def test_server_passes_the_options_to_the_template():
    async def body(c):
        r = await c.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False,
                                            "continue_final_message": True,
                                            "chat_template_kwargs": {"mood": "calm", "x": 1}})
        assert r.status_code == 200, r.text
        assert _prompt_text(r.json()["tokens"]) == "<mood=calm><x=1><user>Hi\n<assistant>The answer is"
        r = await c.post("/tokenize", json={"messages": CHAT})
        assert _prompt_text(r.json()["tokens"]) == "<mood=server><user>Hi\n<assistant>The answer is\n<assistant>"
        r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3,
                                                       "chat_template_kwargs": {"x": 2}})
        assert r.status_code == 200, r.text
        prompt = "<mood=server><x=2><user>Hi\n<assistant>The answer is\n<assistant>"
        assert r.json()["usage"]["prompt_tokens"] == len(prompt.encode())
    _serve(body, chat_defaults=ChatOptions(template_kwargs={"mood": "server"}))


def test_server_template_override_and_info():
    async def body(c):
        r = await c.post("/tokenize", json={"messages": CHAT[:1]})
        assert _prompt_text(r.json()["tokens"]) == "<template MINE><user>Hi\n<assistant>"
        info = (await c.get("/tokenizer_info")).json()
        assert info["chat_template"] == "MINE"
    _serve(body, chat_defaults=ChatOptions(template="MINE"))


def test_chat_echo_prepends_the_assistant_message_streamed_or_not():
    async def body(c):
        req = {"messages": CHAT, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
               "continue_final_message": True}
        r = await c.post("/v1/chat/completions", json=req)
        assert r.json()["choices"][0]["message"]["content"] == "The answer isHel"
        r = await c.post("/v1/chat/completions", json={**req, "stream": True})
        chunks = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
        deltas = [ch["choices"][0]["delta"].get("content") for ch in chunks]
        assert deltas[0] == "" and deltas[1] == "The answer is" and "".join(deltas) == "The answer isHel"
        # no echo when the last message is not the assistant's
        r = await c.post("/v1/chat/completions", json={"messages": CHAT[:1], "max_tokens": 3, "echo": True})
        assert r.json()["choices"][0]["message"]["content"] == "Hel"
    _serve(body)


@pytest.mark.parametrize("extra, param, needle", [
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt to be false"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "may not set tokenize"),
    ({"chat_template": "{{ 1 }}"}, "chat_template", "--chat-template"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "valid dictionary"),
    ({"messages": [{"role": "assistant", "content": "first"}]}, "messages", "the chat template rejected"),
])
def test_server_bad_options_are_400_naming_the_field(extra, param, needle):
    async def body(c):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = await c.post(path, json={"messages": CHAT, "max_tokens": 2, **extra})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert needle in err["message"] and err["param"] == param, (path, err)
        assert (await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})).status_code == 200
    _serve(body)


# ---------------------------------------------------------------- flags, batch jobs, Ray rows
def test_flags_read_a_template_inline_or_from_a_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(SHOW)
    assert read_chat_template(str(f)) == SHOW == read_chat_template(SHOW)
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    a = SimpleNamespace(chat_template=str(f), chat_template_kwargs='{"mood": "calm"}')
    assert chat_defaults(a) == ChatOptions(template_kwargs={"mood": "calm"}, template=SHOW)
    with pytest.raises(ValueError, match="must be a JSON object"):
        chat_defaults(SimpleNamespace(chat_template=None, chat_template_kwargs="[1]"))


@pytest.mark.subprocess
def test_serve_refuses_bad_template_flags_before_loading_a_model():
    r = subprocess.run([sys.executable, "-m", "slipstream.cli", "serve", "--port", "0",
                        "--default-chat-template-kwargs", "{not json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "must be a JSON object" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_batch_job_lines_carry_their_own_options(tokenized_tiny, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "kw", "messages": CHAT[:1], "chat_template_kwargs": {"mood": "sad"}},
            {"id": "default", "messages": CHAT[:1]},
            {"id": "cont", "messages": CHAT, "add_generation_prompt": False, "continue_final_message": True},
            {"id": "both", "messages": CHAT, "continue_final_message": True},
            {"id": "plain", "prompt_token_ids": [5, 6], "chat_template_kwargs": {"mood": "x"}}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["generate", "--model", tokenized_tiny, "--input", str(src), "--output", str(dst),
                 "--device", "cpu", "--quiet", "--max-model-len", "256", "--max-tokens", "2",
                 "--chat-template", SHOW, "--chat-template-kwargs", '{"mood": "calm"}']) == 0
    out = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    tok = load_tokenizer(tokenized_tiny)
    expect = {"kw": "[user]Hi\n(mood=sad)[assistant]", "default": "[user]Hi\n(mood=calm)[assistant]",
              "cont": "[user]Hi\n[assistant]The answer is"}  # cut after the last message's content
    for rid, text in expect.items():
        assert out[rid]["num_input_tokens"] == len(tok.hf.encode(text, add_special_tokens=False)), rid
    assert "add_generation_prompt to be false" in out["both"]["error"]
    assert "apply to chats only" in out["plain"]["error"]


def test_ray_rows_take_the_processors_options_and_their_own():
    tok = FakeTokenizer()
    defaults = RowDefaults(chat=ChatOptions(template_kwargs={"mood": "calm"}))

    def row_prompt(row):
        return parse_ray_row(row, defaults).engine_prompt(tok)

    ids = row_prompt({"messages": CHAT[:1], "chat_template_kwargs": {"mood": "sad", "x": None}})
    assert tok.decode(ids) == "<mood=sad><user>Hi\n<assistant>"
    assert tok.decode(row_prompt({"messages": CHAT[:1]})) == "<mood=calm><user>Hi\n<assistant>"
    with pytest.raises(ValueError, match="apply to chats only"):
        row_prompt({"prompt": "x", "chat_template_kwargs": {"a": 1}})


def test_llm_chat_continues_the_final_message(tokenized_tiny):
    from slipstream import LLM, SamplingParams

    tok = load_tokenizer(tokenized_tiny)
    with LLM(tokenized_tiny, device="cpu", max_model_len=256) as llm:
        params = SamplingParams(max_tokens=2, temperature=0)
        (out,) = llm.chat(CHAT, params, add_generation_prompt=False, continue_final_message=True,
                          chat_template=SHOW, chat_template_kwargs={"mood": "calm"})
        want = chat_token_ids(CHAT, tok, ChatOptions(False, True, {"mood": "calm"}, SHOW))
        assert out.prompt_token_ids == want
        assert tok.decode(want) == "[user]Hi\n[assistant]The answer is"
        with pytest.raises(ValueError, match="add_generation_prompt to be false"):
            llm.chat(CHAT, params, continue_final_message=True)
