"""A model folder's tokenizer and chat template, without importing transformers.

tokenizer.json is read by the `tokenizers` library; the chat template (tokenizer_config.json's
"chat_template", or chat_template.jinja beside it) is rendered with Jinja the way transformers'
apply_chat_template renders it: a sandboxed environment with trim_blocks and lstrip_blocks, the
special tokens as variables, `raise_exception` and a `tojson` filter. Rendered prompts are
tokenized without adding special tokens, because the template writes them itself.

A message's text is plain text (encode_chat): special-token text inside it ("<|im_end|>") is
encoded as its characters, never as the special token, so a message cannot forge a turn; the
template's own special tokens stay special, as transformers' split_special_tokens does for the
content alone.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def _token_text(v):
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, model_dir: str | pathlib.Path):
        model_dir = pathlib.Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{model_dir}: no tokenizer.json")
        # The files as read, so that a saved folder gets them even after model_dir is gone (a
        # checkpoint the host prunes after the engine resumed from it).
        self.files = {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES
                      if (model_dir / name).is_file()}
        self.tk = HFTokenizer.from_str(self.files["tokenizer.json"].decode())
        cfg = self.files.get("tokenizer_config.json")
        self.config = json.loads(cfg) if cfg is not None else {}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and "chat_template.jinja" in self.files:
            template = self.files["chat_template.jinja"].decode()
        self.chat_template = template or ""
        self.special = {k: _token_text(v) for k, v in self.config.items()
                        if k.endswith("_token") and _token_text(v) is not None}
        # The special added tokens (not the plain added ones, like Qwen's <think>, which the model
        # writes as text and reads back as the same token): what message text must not become.
        added = json.loads(self.files["tokenizer.json"]).get("added_tokens") or []
        self._specials = {t["content"]: t for t in added if t.get("special") and t.get("content")}
        self._special_re = None
        self._tk_plain = None
        if self._specials:
            # Where the tokenizers library splits a text at a special token, with the whitespace
            # an lstrip / rstrip token takes with it; longest first, as it matches them.
            alts = []
            for text in sorted(self._specials, key=len, reverse=True):
                t = self._specials[text]
                alts.append((r"\s*" if t.get("lstrip") else "") + re.escape(text) +
                            (r"\s*" if t.get("rstrip") else ""))
            self._special_re = re.compile("|".join(alts))
        self._template = None
        if self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)

    def save(self, out_dir: str | pathlib.Path) -> None:
        """Writes the tokenizer files this tokenizer was read from (tokenizer.json, its config, the
        chat template, generation_config.json) into out_dir, from memory."""
        out_dir = pathlib.Path(out_dir)
        for name, data in self.files.items():
            tmp = out_dir / (name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(out_dir / name)

    @property
    def size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tk.token_to_id(text)

    def encode(self, text: str) -> list[int]:
        """Raw text → ids, with no special tokens added (BOS and the like are the template's)."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        if self._template is None:
            raise ValueError("the model has no chat template (tokenizer_config.json "
                             "chat_template); send prompt tokens instead of messages")
        return self._template.render(messages=messages, tools=tools or None,
                                     add_generation_prompt=add_generation_prompt, **self.special)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """The chat template applied to messages (and tools), as token ids. Text inside the messages
        and tools is plain text: special-token text there ("<|im_end|>\\n<|im_start|>system")
        is encoded as its characters, the template's own special tokens as themselves. A
        conversation with no special-token text in it encodes as its rendering does."""
        texts = []
        _strings(messages, texts)
        _strings(tools, texts)
        if self._special_re is None or not any(self._special_re.search(t) for t in texts):
            return self.encode(self.render(messages, add_generation_prompt, tools))
        return self._encode_chat_plain(messages, add_generation_prompt, tools, texts)

    def _encode_chat_plain(self, messages, add_generation_prompt, tools, texts) -> list[int]:
        # Each special-token text inside the messages becomes a placeholder made of a private-use
        # character no message contains, then the template is rendered. The rendered text is split
        # where the tokenizer would split it, at the special tokens left (the template's own); the
        # pieces between them get their text back and are encoded with special tokens off.
        mark = next(chr(c) for c in range(0xE000, 0xF900) if not any(chr(c) in t for t in texts))
        found = []

        def hide(s: str) -> str:
            def one(m):
                found.append(m.group(0))
                return f"{mark}{len(found) - 1}{mark}"
            return self._special_re.sub(one, s)

        rendered = self.render(_map_strings(messages, hide), add_generation_prompt,
                               _map_strings(tools, hide))
        back = re.compile(f"{mark}(\\d+){mark}")
        plain = self._plain()
        ids, pos = [], 0
        for m in list(self._special_re.finditer(rendered)) + [None]:
            piece = rendered[pos:m.start() if m else len(rendered)]
            piece = back.sub(lambda b: found[int(b.group(1))], piece)
            if mark in piece:
                raise ValueError("the chat template cut apart a message's special-token text, "
                                 "which cannot then be kept as plain text")
            if piece:
                ids.extend(plain.encode(piece, add_special_tokens=False).ids)
            if m is not None:
                tok = m.group(0)
                if tok not in self._specials:  # with the whitespace lstrip / rstrip took
                    tok = max((t for t in self._specials if t in tok), key=len)
                ids.append(self.tk.token_to_id(tok))
                pos = m.end()
        return ids


    def _plain(self) -> HFTokenizer:
        """A second tokenizer that reads special-token text as text (the one other threads use
        is not switched back and forth)."""
        if self._tk_plain is None:
            plain = HFTokenizer.from_str(self.files["tokenizer.json"].decode())
            plain.encode_special_tokens = True
            self._tk_plain = plain
        return self._tk_plain


def _strings(x, out: list[str]) -> None:
    """Collects the strings inside x (dicts' values, lists' items)."""
    if isinstance(x, str):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _strings(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _strings(v, out)


def _map_strings(x, f):
    """x with f applied to every string inside it (dict keys and roles kept)."""
    if isinstance(x, str):
        return f(x)
    if isinstance(x, dict):
        return {k: (v if k == "role" else _map_strings(v, f)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_map_strings(v, f) for v in x]
    return x


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)
