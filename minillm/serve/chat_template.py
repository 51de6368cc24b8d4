"""Chat messages -> one prompt string, with the model's own Jinja2 chat template.

A model directory names its template in `tokenizer_config.json` (`"chat_template"`: a string,
or a list of `{"name", "template"}` from which "default" is taken) or in a
`chat_template.jinja` file beside it. It is rendered as transformers'
`apply_chat_template` renders it, so that the same messages give the same prompt here and
there:

- a sandboxed Jinja2 environment with `trim_blocks` and `lstrip_blocks` on and the
  `loopcontrols` extension (`{% break %}`, `{% continue %}`);
- the variables `messages` (a list of `{"role", "content"}`), `add_generation_prompt`,
  `tools` and `documents` (None here), and the special tokens by name (`bos_token`,
  `eos_token`, `pad_token`, `unk_token`) as strings;
- the helpers `raise_exception(message)` and `strftime_now(format)`.

The text it renders already holds the special tokens the template wants (a BOS, usually),
so it is tokenized without adding them again (transformers does the same).
"""

from __future__ import annotations

import datetime
import json
import pathlib

import jinja2
import jinja2.ext
import jinja2.sandbox

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The template could not render these messages (or the model has no template)."""


def _token_text(value: object) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # {"content": "<s>"}


def load_chat_template(model_dir: str | pathlib.Path) -> str | None:
    """The chat template of a model directory, or None when it has none."""
    model_dir = pathlib.Path(model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_file}: chat_template must be a string, got {template!r:.80}")
    return template


def special_tokens(model_dir: str | pathlib.Path) -> dict[str, str | None]:
    """The special tokens' strings, as the template sees them (tokenizer_config.json wins
    over special_tokens_map.json, as in the tokenizer)."""
    found: dict[str, str | None] = dict.fromkeys(SPECIAL_TOKEN_NAMES)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = pathlib.Path(model_dir) / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            found.update({k: _token_text(data[k]) for k in SPECIAL_TOKEN_NAMES if k in data})
    return found


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces Jinja2's tojson (which escapes HTML) by plain json.dumps
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, tokens: dict[str, str | None]) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not parse: {err}") from None
        self.tokens = tokens

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path) -> ChatTemplate | None:
        source = load_chat_template(model_dir)
        return None if source is None else cls(source, special_tokens(model_dir))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; ChatTemplateError when the template refuses them."""
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.tokens,
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(
                f"the chat template cannot render these messages: {err}"
            ) from None
