"""A model folder's tokenizer and chat template, without importing transformers.

tokenizer.json is read by the `tokenizers` library; the chat template (tokenizer_config.json's
"chat_template", or chat_template.jinja beside it) is rendered with Jinja the way transformers'
apply_chat_template renders it: a sandboxed environment with trim_blocks and lstrip_blocks, the
special tokens as variables, `raise_exception` and a `tojson` filter. Rendered prompts are
tokenized without adding special tokens, because the template writes them itself.
"""

from __future__ import annotations

import datetime
import json
import pathlib

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
        return self.encode(self.render(messages, add_generation_prompt, tools))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)
