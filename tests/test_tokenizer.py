"""jaxinfer.tokenizer against the hf-tiny fixtures' real tokenizer files and golden ids."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError, byte_level_tokenizer_json

NAMES = ["llama", "llama3_scaled", "qwen2", "qwen3"]
TEXT = "Distributed inference, naïve café 😀 — splits across devices!"


@pytest.fixture(scope="module")
def tok(hf_tiny):
    return Tokenizer.from_dir(hf_tiny / "llama")


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytelevel")
    (d / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(d)


@pytest.fixture
def llama_copy(tmp_path, hf_tiny) -> Path:
    """A writable copy of the tiny Llama's tokenizer and config files (no weights)."""
    d = tmp_path / "llama"
    shutil.copytree(hf_tiny / "llama", d, ignore=shutil.ignore_patterns("*.safetensors*", "golden.*"))
    return d


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_golden(name, hf_tiny, golden):
    t = Tokenizer.from_dir(hf_tiny / name)
    g = golden(name)
    assert t.bos_id == 1 and t.pad_id == 3 and 2 in t.eos_ids
    assert len(g.texts) == len(g.prompts)
    for prompt, want in zip(g.texts, g.prompts, strict=True):
        assert want[0] == 1
        assert t.encode(prompt, add_bos=True) == want
        assert t.encode(prompt) == want[1:]  # no BOS from post-processor, no add_bos_token
        assert t.encode(prompt, add_bos=False) == want[1:]
        assert t.decode(t.encode(prompt)) == prompt
        assert t.decode(want) == prompt  # BOS skipped as a special token


def test_add_bos_never_twice(tok):
    assert tok.encode("<s>Ring", add_bos=True) == [1, 334]
    assert tok.encode("<s>Ring", add_bos=False) == [1, 334]  # a BOS written in the text is not stripped


def test_add_bos_token_from_config(llama_copy):
    d = llama_copy
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    t = Tokenizer.from_dir(d)
    assert t.encode("Ring") == [1, 334]
    assert t.encode("Ring", add_bos=False) == [334]


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == "<s>user: Hi</s><s>assistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<s>user: Hi</s>"
    ids = tok.chat_ids(msgs)
    assert ids[0] == 1 and ids[1] != 1
    assert tok.decode(ids, skip_special_tokens=False) == "<s>user: Hi</s><s>assistant:"


def test_chat_template_from_tokenizer_config(llama_copy):
    d = llama_copy
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    default = (  # the newline after the block tag goes, as with transformers' trim_blocks
        "{{ bos_token }}{% for m in messages %}\n{{ m['content'] }}{{ eos_token }}"
        "{% if m['role'] == 'x' %}{{ raise_exception('bad role') }}{% endif %}{% endfor %}"
    )
    cfg["chat_template"] = [{"name": "tool_use", "template": "tools"},
                            {"name": "default", "template": default}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<s>Hi</s>"
    with pytest.raises(TokenizerError, match="bad role"):
        t.apply_chat_template([{"role": "x", "content": "Hi"}])


def test_no_chat_template(llama_copy):
    d = llama_copy
    (d / "chat_template.jinja").unlink()
    t = Tokenizer.from_dir(d)
    with pytest.raises(TokenizerError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path)


def test_eos_ids_merged(llama_copy):
    d = llama_copy
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [5, 7]}))
    t = Tokenizer.from_dir(d)
    assert sorted(t.eos_ids) == [2, 5, 7]


def test_ids_from_model_configs_without_tokenizer_config(llama_copy):
    d = llama_copy
    (d / "tokenizer_config.json").unlink()
    t = Tokenizer.from_dir(d)
    assert (t.bos_id, t.eos_ids, t.pad_id) == (1, [2], 3)


def test_info_is_the_config_as_transformers_holds_it(llama_copy):
    """vLLM's /tokenizer_info body: AddedToken dicts as their text, no file paths, the template in use, and the
    special tokens the config leaves out."""
    d = llama_copy
    added = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", **added}, "added_tokens_decoder": {"1": added},
        "vocab_file": "/somewhere/vocab.json", "merges_file": "merges.txt", "chat_template": "ignored",
        "model_max_length": 10**30, "extra": {"content": 5}}))
    info = Tokenizer.from_dir(d).info()
    assert info == {"bos_token": "<s>", "added_tokens_decoder": {"1": "<s>"}, "model_max_length": 10**30,
                    "extra": {"content": 5}, "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                    "pad_token": "<pad>", "chat_template": (d / "chat_template.jinja").read_text()}
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    info = Tokenizer.from_dir(d).info()   # no template, no config tokens: those found in config.json by id
    assert info == {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def _stream(t, ids, prompt_ids=(), **kw):
    det = IncrementalDetokenizer(t, list(prompt_ids), **kw)
    deltas = [det.add(i) for i in ids]
    return det, deltas


@pytest.mark.parametrize("which", ["tok", "byte_tok"])
def test_incremental_deltas_concat_to_decode(which, request):
    t = request.getfixturevalue(which)
    prompt = t.encode("The quick brown fox", add_bos=True)
    ids = t.encode(" " + TEXT)
    det, deltas = _stream(t, ids, prompt)
    deltas.append(det.finish())
    assert "".join(deltas) == t.decode(ids) == det.text
    assert not det.stopped
    assert det.output_ids == ids


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("The quick brown fox jumps")
    stop = "ck br"  # tokens: ... " quick", " brown" ...
    assert not any(stop in tok.decode([i]) for i in ids)
    det, deltas = _stream(tok, ids, [1], stop=[stop])
    assert det.stopped
    assert det.text == "The qui"
    assert "".join(deltas) == det.text
    assert det.add(5) == "" and det.finish() == ""

    det, deltas = _stream(tok, ids, [1], stop=["zzz", stop], include_stop_str_in_output=True)
    assert det.stopped and det.text == "The quick br"
    assert "".join(deltas) == det.text


def test_stop_string_held_back_until_finish(tok):
    ids = tok.encode("The quick brown")
    det, deltas = _stream(tok, ids, [1], stop=["brownie"])
    assert not det.stopped
    assert "".join(deltas) == "The quick"  # the last len(stop)-1 = 6 chars are held back
    assert "".join(deltas) + det.finish() == "The quick brown" == det.text


def test_multibyte_never_replacement_char(byte_tok):
    text = "é😀 naïve 🇫🇷 中文"
    ids = byte_tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: chars split over tokens
    det, deltas = _stream(byte_tok, ids, [1])
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # incomplete chars were held back
    assert "".join(deltas) == text == det.text


def test_invalid_utf8_tail_flushed_on_finish(byte_tok):
    det, deltas = _stream(byte_tok, [4 + ord("a"), 4 + 0xE2, 4 + 0x82], [1])
    assert deltas == ["a", "", ""]
    assert det.finish() == "\ufffd"


def test_byte_level_tokenizer_json(byte_tok):
    vocab = json.loads(byte_level_tokenizer_json())["model"]["vocab"]
    assert len(vocab) == 260
    assert [vocab[s] for s in ("<unk>", "<s>", "</s>", "<pad>")] == [0, 1, 2, 3]
    assert byte_tok.vocab_size == 260
    assert byte_tok.bos_id == 1 and byte_tok.eos_ids == [2]
    assert byte_tok.encode("A") == [4 + ord("A")]
    assert byte_tok.encode("A", add_bos=True) == [1, 4 + ord("A")]
    rng = np.random.default_rng(0)
    for text in [TEXT, "  leading\tand\r\ntrailing  ", "\x00\x7f\u0080\uffff\U0010ffff", "<s> </s>"]:
        assert byte_tok.decode(byte_tok.encode(text), skip_special_tokens=False) == text
    for _ in range(20):
        text = "".join(chr(c) for c in rng.integers(0, 0x10FFFF, 30) if not 0xD800 <= c < 0xE000)
        ids = byte_tok.encode(text)
        assert ids == [4 + b for b in text.encode("utf-8")]
        assert byte_tok.decode(ids) == text
