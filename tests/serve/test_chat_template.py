"""Chat templates rendered as transformers' apply_chat_template renders them (the oracle:
transformers itself, on the same model directory)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from minillm.model.loader import resolve_model_path
from minillm.model.tokenizer import Tokenizer
from minillm.serve.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Sort a list."}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Read a file."},
        {"role": "assistant", "content": "with open(p) as f:\n    data = f.read()"},
        {"role": "user", "content": "Now in binary, ünïcode ✓."},
    ],
]
# a template in the style of real ones: a loop control, raise_exception, tojson, the tokens
STRICT_TEMPLATE = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('a chat starts with the user') }}"
    "{% endif %}{{ bos_token }}{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}"
    "{% endif %}[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def bundled():
    return resolve_model_path("minillm-stdlib-target")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_bundled_template_renders_as_transformers_does(
    bundled, messages, add_generation_prompt
):
    reference = AutoTokenizer.from_pretrained(bundled)
    expected = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ours = ChatTemplate.from_model_dir(bundled).render(messages, add_generation_prompt)
    assert ours == expected
    # and the prompt's tokens: the template's own BOS, none added on top
    expected_ids = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert Tokenizer(bundled).encode(ours, add_special_tokens=False) == list(expected_ids)


def test_a_template_with_loop_controls_and_raise_exception(bundled, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(bundled, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "default", "template": STRICT_TEMPLATE}]
    config_path.write_text(json.dumps(config))
    messages = CONVERSATIONS[0] + [{"role": "skip", "content": "-"}]
    template = ChatTemplate.from_model_dir(model_dir)
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert (
        template.render(messages) == expected == '<|bos|>[user] "Sort a list."<|eos|>\n[assistant] '
    )
    with pytest.raises(ChatTemplateError, match="a chat starts with the user"):
        template.render(CONVERSATIONS[1])


def test_a_model_without_a_template_has_none(bundled, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(bundled, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(model_dir) is None
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert (
        ChatTemplate.from_model_dir(model_dir).render([{"role": "user", "content": "hi"}]) == "hi"
    )
