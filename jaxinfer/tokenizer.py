"""Host-side text handling: Hugging Face tokenizer.json + chat templates, incremental detokenization.

The device program only sees token ids; everything that touches text (encoding, chat templates,
streaming text deltas, stop strings) lives here, on the host, as in vLLM.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or cannot do what was asked."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(tok: Any) -> str | None:
    """tokenizer_config special tokens are a string or a serialized AddedToken dict."""
    return tok.get("content") if isinstance(tok, dict) else tok


_ADDED_TOKEN_KEYS = {"__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"}


def _added_token_text(x: Any) -> Any:
    """A tokenizer_config value with every serialized AddedToken ({"content": ..., "special": ...}) as its text, as
    transformers loads them and vLLM writes them back."""
    if isinstance(x, dict):
        if isinstance(x.get("content"), str) and set(x) <= _ADDED_TOKEN_KEYS:
            return x["content"]
        return {k: _added_token_text(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_added_token_text(v) for v in x]
    return x


def _as_list(x: Any) -> list[int]:
    return [] if x is None else [int(v) for v in x] if isinstance(x, list) else [int(x)]


class Tokenizer:
    """A checkpoint's tokenizer.json plus the special ids and chat template around it."""

    def __init__(self, tok: tokenizers.Tokenizer, config: dict | None = None,
                 chat_template: str | None = None, model_config: dict | None = None,
                 generation_config: dict | None = None):
        self._tok = tok
        cfg, mcfg, gcfg = config or {}, model_config or {}, generation_config or {}
        self.config = dict(cfg)   # tokenizer_config.json as written
        self.chat_template = chat_template
        self.add_bos_token = bool(cfg.get("add_bos_token", False))

        def special(name: str) -> int | None:
            # The tokenizer config names the token; model/generation configs give the id as a fallback.
            s = _token_str(cfg.get(f"{name}_token"))
            if s is not None and tok.token_to_id(s) is not None:
                return tok.token_to_id(s)
            ids = _as_list(gcfg.get(f"{name}_token_id")) or _as_list(mcfg.get(f"{name}_token_id"))
            return ids[0] if ids else None

        self.bos_id: int | None = special("bos")
        self.pad_id: int | None = special("pad")
        eos = _as_list(gcfg.get("eos_token_id")) + _as_list(mcfg.get("eos_token_id"))
        eos_tok = _token_str(cfg.get("eos_token"))
        if eos_tok is not None and tok.token_to_id(eos_tok) is not None:
            eos.append(tok.token_to_id(eos_tok))
        # Any of these ends generation: instruct checkpoints list several (<|eot_id|>, <|end_of_text|>).
        self.eos_ids: list[int] = list(dict.fromkeys(eos))
        self.bos_token = self._id_str(self.bos_id) or _token_str(cfg.get("bos_token"))
        self.eos_token = self._id_str(self.eos_ids[0] if self.eos_ids else None) or eos_tok

    def _id_str(self, i: int | None) -> str | None:
        return None if i is None else self._tok.id_to_token(i)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load what a Hugging Face checkpoint directory says about its text handling."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"no tokenizer.json at {tj}")
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").is_file():  # newer checkpoints keep it in its own file, which wins
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tokenizers.Tokenizer.from_file(str(tj)), cfg, template,
                   _read_json(path / "config.json"), _read_json(path / "generation_config.json"))

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info body: tokenizer_config.json as transformers holds it (its init_kwargs: a
        serialized AddedToken as its text, no vocab_file or merges_file), `tokenizer_class` (the config's; a
        fast tokenizer's own name where it gives none), bos/eos/pad tokens where the config leaves out one this
        tokenizer found (clients such as lm-evaluation-harness's remote tokenizer read `eos_token`), and
        `chat_template`, the one in use (chat_template.jinja before the config's)."""
        info = {k: _added_token_text(v) for k, v in self.config.items()
                if k not in ("vocab_file", "merges_file", "chat_template")}
        info["tokenizer_class"] = info.get("tokenizer_class") or "PreTrainedTokenizerFast"
        for name, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                            ("pad_token", self._id_str(self.pad_id))):
            if token is not None and info.get(name) is None:
                info[name] = token
        if self.chat_template:
            info["chat_template"] = self.chat_template
        return info

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Encode with the checkpoint's post-processor; add_bos forces (True) or strips (False) the BOS.

        None follows the checkpoint: the post-processor, plus a BOS when tokenizer_config says add_bos_token
        and the post-processor did not put one first (as transformers' Llama tokenizers behave).
        """
        enc = self._tok.encode(text, add_special_tokens=True)
        ids, bos = list(enc.ids), self.bos_id
        starts_bos = bos is not None and ids[:1] == [bos]
        if add_bos is None:
            add_bos = self.add_bos_token or None
        if add_bos and not starts_bos:
            if bos is None:
                raise TokenizerError("add_bos requested but this tokenizer has no BOS token")
            ids.insert(0, bos)
        elif add_bos is False and starts_bos and enc.special_tokens_mask[0]:  # only a post-processor BOS
            ids.pop(0)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render the checkpoint's chat template as transformers does (extra: tools, enable_thinking...)."""
        if self.chat_template is None:
            raise TokenizerError("this checkpoint has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])

        def raise_exception(msg: str) -> None:
            raise TokenizerError(f"chat template: {msg}")

        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def chat_ids(self, messages: list[dict], **extra: Any) -> list[int]:
        """Template text to ids with no special tokens added: the template already wrote its BOS."""
        text = self.apply_chat_template(messages, **extra)
        return list(self._tok.encode(text, add_special_tokens=False).ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and finds stop strings, as vLLM does on the host.

    Text is decoded from ids over a sliding window (vLLM's prefix/read offsets), seeded with the prompt's
    last tokens so decoders that drop a leading space (SentencePiece) or join bytes (byte-level BPE) see
    context. A window ending in U+FFFD is an incomplete UTF-8 char and waits for more tokens. Without
    include_stop_str_in_output, the last len(longest stop)-1 chars are held back so a delta never has to
    be taken back; finish() releases them. Concatenated deltas always equal `text`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop or [] if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ids = list(prompt_ids)
        self._n_prompt = len(self._ids)
        self._prefix = max(len(self._ids) - 5, 0)
        self._read = len(self._ids)
        self._out = ""  # decoded output text, truncated once a stop string matched
        self._emitted = 0
        self._hold = 0 if include_stop_str_in_output else max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False
        self.stop_string: str | None = None   # the stop string that matched, once one has
        self.finished = False

    @property
    def text(self) -> str:
        return self._out

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._n_prompt:]

    def _decode_step(self, force: bool) -> str:
        prefix = self.tokenizer.decode(self._ids[self._prefix:self._read])
        new = self.tokenizer.decode(self._ids[self._prefix:])
        if len(new) > len(prefix) and (force or not new.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return new[len(prefix):]
        return ""

    def _append(self, new: str) -> None:
        if not new or self.stopped:
            return
        start = max(len(self._out) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self._out += new
        hits = [(i, s) for s in self.stop if (i := self._out.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            self._out = self._out[: i + len(s) if self.include_stop_str_in_output else i]
            self.stopped, self.stop_string = True, s

    def _emit(self, hold: int) -> str:
        end = max(len(self._out) - hold, self._emitted)
        delta, self._emitted = self._out[self._emitted:end], end
        return delta

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text that is now certain (may be "")."""
        if self.stopped or self.finished:
            return ""
        self._ids.append(int(token_id))
        self._append(self._decode_step(force=False))
        return self._emit(0 if self.stopped else self._hold)

    def finish(self) -> str:
        """Generation ended (EOS, length): flush held-back text, even an invalid UTF-8 tail."""
        if not self.finished and not self.stopped:
            self._append(self._decode_step(force=True))
        self.finished = True
        return self._emit(0)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char map that byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_level_tokenizer_json(
    vocab_extra_specials: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>"),
) -> str:
    """A byte-level BPE tokenizer.json with no merges, for the embedded random-weight default model.

    Ids: the specials first, in the given order (default <unk>=0, <s>=1, </s>=2, <pad>=3, the same ids
    as the hf-tiny fixtures and Llama), then the 256 bytes in byte order: byte b is id len(specials) + b.
    Every UTF-8 string encodes (one token per byte) and decodes back exactly. No post-processor: no BOS
    is added by encode unless asked.
    """
    n = len(vocab_extra_specials)
    vocab = {s: i for i, s in enumerate(vocab_extra_specials)}
    vocab.update({ch: n + b for b, ch in _bytes_to_unicode().items()})
    unk = "<unk>" if "<unk>" in vocab_extra_specials else None
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token=unk))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False)
                            for s in vocab_extra_specials])
    return tok.to_str()
