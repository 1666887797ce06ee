"""The Jinja chat template saved with the tokenizer gives the renderer's ids and loss mask on every
shipped trajectory, and its generation prompt is the renderer's prompt."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import TemplateError

from posttrain.data.chat import CHAT_TEMPLATE, DEFAULT_TOKENIZER_DIR


def test_template_matches_renderer_on_every_shipped_trajectory(tokenizer, renderer, shipped):
    assert len(shipped) >= 300
    for record in shipped:
        ids, mask = renderer.render(record["messages"], record["tools"], record["effort"])
        out = tokenizer.apply_chat_template(
            record["messages"],
            tools=record["tools"],
            effort=record["effort"],
            tokenize=True,
            return_assistant_tokens_mask=True,
        )
        assert out["input_ids"] == ids, record["uid"]
        assert out["assistant_masks"] == mask, record["uid"]


def test_generation_prompt_is_the_render_prompt(tokenizer, renderer, shipped):
    for record in shipped[::7]:
        messages = record["messages"]
        for k in (2, len(messages) - 1):
            history = messages[:k]
            expected = renderer.render_prompt(history, record["tools"], record["effort"])
            got = tokenizer.apply_chat_template(
                history,
                tools=record["tools"],
                effort=record["effort"],
                add_generation_prompt=True,
                return_dict=False,
            )
            assert got == expected


def test_template_without_tools_or_effort(tokenizer, renderer, conversation):
    plain = conversation[:2] + [{"role": "assistant", "content": "5"}]
    assert tokenizer.apply_chat_template(plain, return_dict=False) == renderer.render(plain)[0]


def test_template_rejects_what_the_renderer_rejects(tokenizer):
    with pytest.raises(TemplateError, match="unknown role 'robot'"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    with pytest.raises(TemplateError, match="unknown effort 'medium'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], effort="medium", tokenize=False)


def test_template_is_saved_inside_tokenizer_config():
    config = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
