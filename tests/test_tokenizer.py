"""The tokenizer wrapper: the embedded SmolLM2 (GGUF), a HF folder, and folders without one."""
import json
import shutil

import pytest
from helpers import make_hf_model

from slipstream.model.tokenizer import Tokenizer, load_tokenizer

CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.mark.parametrize("text", ["Hello world", "  leading spaces\nand\ttabs\n\n",
                                  "Ünïcödé — 東京 🚀", "def f(x):\n    return x ** 2"])
@pytest.mark.slow
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_encode_matches_model_convention(tok):
    # SmolLM2's GGUF says add_bos_token = false: plain text gets no BOS
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.vocab_size == 49152


def test_chat_template_is_chatml(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids, skip_special_tokens=False) == CHATML
    assert ids[0] == 1 and tok.convert_ids_to_tokens([ids[0]]) == ["<|im_start|>"]
    assert tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]) == CHATML


def test_eos(tok):
    assert tok.eos_token_ids == {2}
    assert tok.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tok.decode([504, 2]) == "The" and tok.decode([504, 2], skip_special_tokens=False) == "The<|im_end|>"


def test_folder_without_tokenizer_is_none(tmp_path):
    make_hf_model("llama3", str(tmp_path))
    assert load_tokenizer(str(tmp_path)) is None
    assert load_tokenizer(str(tmp_path / "config.json")) is None


def test_hf_folder(tok, tmp_path):
    """A saved fast tokenizer in a model folder; eos ids merged from generation_config.json."""
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder_tok = load_tokenizer(str(tmp_path))
    assert folder_tok.eos_token_ids == {0, 2}
    assert folder_tok.encode("Hello world") == tok.encode("Hello world")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert folder_tok.apply_chat_template(chat) == tok.apply_chat_template(chat)

    without = tmp_path / "no_template"
    shutil.copytree(tmp_path, without, ignore=shutil.ignore_patterns("no_template"))
    for f in without.glob("chat_template.*"):
        f.unlink()
    cfg = json.loads((without / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (without / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = load_tokenizer(str(without))
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="has no chat template"):
        plain.apply_chat_template(chat)


def _gguf_builds(monkeypatch) -> list:
    """Spy on rebuilds of the tokenizer from a GGUF file (calls with gguf_file=)."""
    from transformers import PreTrainedTokenizerFast
    calls, real = [], PreTrainedTokenizerFast.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return real(cls, *args, **kwargs)
    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", classmethod(spy))
    return calls


@pytest.mark.slow  # rebuilds the tokenizer from the GGUF file twice
def test_gguf_tokenizer_is_cached_and_the_cached_one_is_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    builds = _gguf_builds(monkeypatch)
    built = load_tokenizer(None)
    entries = list((tmp_path / "gguf-tokenizers").iterdir())
    assert len(builds) == 1 and len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    cached = load_tokenizer(None)
    assert len(builds) == 1  # read from the cache, not rebuilt
    texts = ["Hello world", "  leading spaces\nand\ttabs\n\n", "Ünïcödé — 東京 🚀", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert cached.encode(text) == built.encode(text)
        assert cached.decode(built.encode(text), skip_special_tokens=False) == built.decode(
            built.encode(text), skip_special_tokens=False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert cached.render_chat(messages) == built.render_chat(messages) == CHATML
    assert (cached.eos_token_ids, cached.bos_token_id, cached.vocab_size) == (
        built.eos_token_ids, built.bos_token_id, built.vocab_size)
    # a damaged entry is dropped and rebuilt
    (entries[0] / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(None)
    assert len(builds) == 2 and again.encode("Hello world") == [19556, 905]
    assert json.loads((entries[0] / "tokenizer.json").read_text())


@pytest.mark.slow
def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache root is a file: nothing can be made under it
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(blocker))
    assert load_tokenizer(None).encode("Hello world") == [19556, 905]
