"""ChatRenderer: exact ids and loss masks on hand-written conversations, the exact-prefix rule,
parse_assistant as the inverse of rendering, and any tokenizer made to speak K3 chat."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.data.chat import SPECIAL_TOKENS, ChatRenderer, load_tokenizer


def test_ids_and_mask_at_exact_positions(renderer, conversation, calculator_schema):
    t, encode = renderer.token_ids, renderer.encode
    ids, mask = renderer.render(conversation, [calculator_schema], "low")
    tools_json = json.dumps([calculator_schema], separators=(",", ":"), sort_keys=True)
    # (ids, trained?) segment by segment, in the documented layout.
    segments = [
        ([t["system"], t["effort_low"], t["middle"], *encode("Be brief."), t["end_of_turn"]], 0),
        ([t["system"], *encode("tool_declare"), t["middle"], *encode(tools_json), t["end_of_turn"]], 0),
        ([t["user"], t["middle"], *encode("What is 2+3?"), t["end_of_turn"]], 0),
        ([t["assistant"], t["middle"]], 0),
        (
            [
                t["think_begin"],
                *encode("Add them."),
                t["think_end"],
                t["tool_calls_begin"],
                t["tool_call_begin"],
            ],
            1,
        ),
        ([*encode("functions.calculator:0"), t["tool_call_argument"], *encode('{"expression": "2+3"}')], 1),
        ([t["tool_call_end"], t["tool_calls_end"]], 1),
        ([t["tool"], *encode("functions.calculator:0"), t["middle"], *encode("5"), t["end_of_turn"]], 0),
        ([t["assistant"], t["middle"]], 0),
        ([t["think_begin"], *encode("It is 5."), t["think_end"], *encode("5"), t["end_of_turn"]], 1),
    ]
    assert ids == [i for segment, _ in segments for i in segment]
    assert mask == [trained for segment, trained in segments for _ in segment]

    # The same facts, read off positions: header untrained, thinking and call trained, the call
    # block's end token trained (it ends the turn), the tool result untrained, final <|im_end|> trained.
    first_header = ids.index(t["assistant"])
    assert mask[first_header : first_header + 2] == [0, 0]
    think_begin, think_end = ids.index(t["think_begin"]), ids.index(t["think_end"])
    assert renderer.decode(ids[think_begin + 1 : think_end]) == "Add them."
    assert all(mask[think_begin : think_end + 1])
    calls_end = ids.index(t["tool_calls_end"])
    assert mask[calls_end] == 1 and ids[calls_end + 1] == t["tool"]
    result_end = ids.index(t["end_of_turn"], calls_end)
    assert mask[calls_end + 1 : result_end + 1] == [0] * (result_end - calls_end)
    assert renderer.decode(ids[ids.index(t["middle"], calls_end) + 1 : result_end]) == "5"
    assert ids[-1] == renderer.end_of_turn_id and mask[-1] == 1
    assert sum(mask) == sum(len(s) for s, trained in segments if trained)


def test_effort_marker_and_its_absence(renderer):
    t = renderer.token_ids
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with_effort, _ = renderer.render(messages, effort="max")
    assert with_effort[:4] == [t["system"], t["effort_max"], t["middle"], t["end_of_turn"]]
    without, _ = renderer.render(messages)
    assert without[0] == t["user"] and t["effort_max"] not in without
    with pytest.raises(ValueError, match="unknown effort 'medium'"):
        renderer.render(messages, effort="medium")


def test_assistant_without_thinking_renders_an_empty_think_block(renderer):
    t = renderer.token_ids
    ids, mask = renderer.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    start = ids.index(t["think_begin"])
    assert ids[start : start + 2] == [t["think_begin"], t["think_end"]]
    assert mask[start:] == [1] * (len(ids) - start)


def test_exact_prefix_rule_on_every_shipped_turn(renderer, shipped):
    checked = 0
    for record in shipped:
        messages, tools, effort = record["messages"], record["tools"], record["effort"]
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                whole, mask = renderer.render(messages[: k + 1], tools, effort)
                prompt = renderer.render_prompt(messages[:k], tools, effort)
                assert whole[: len(prompt)] == prompt
                assert whole[len(prompt) :] == renderer.render_assistant(message)
                assert mask[len(prompt) :] == [1] * (len(whole) - len(prompt))
                checked += 1
            elif message["role"] == "tool" and messages[k - 1]["role"] == "assistant":
                end = next(
                    (j for j in range(k, len(messages)) if messages[j]["role"] != "tool"), len(messages)
                )
                before, _ = renderer.render(messages[:k], tools, effort)
                after = renderer.render_prompt(messages[:end], tools, effort)
                assert after == before + renderer.render_tool_results(messages[k:end])
    assert checked > len(shipped)


def test_parse_assistant_inverts_rendering(renderer, shipped, conversation):
    turns = [m for record in shipped for m in record["messages"] if m["role"] == "assistant"]
    turns += [m for m in conversation if m["role"] == "assistant"]
    for message in turns:
        parsed = renderer.parse_assistant(renderer.render_assistant(message))
        expected = {
            "role": "assistant",
            "reasoning_content": message.get("reasoning_content") or "",
            "content": message.get("content") or "",
        }
        if message.get("tool_calls"):
            expected["tool_calls"] = message["tool_calls"]
        assert parsed == expected


def test_parse_assistant_on_cut_and_malformed_output(renderer):
    t, encode = renderer.token_ids, renderer.encode
    cut_thinking = [t["think_begin"], *encode("still thinking")]
    assert renderer.parse_assistant(cut_thinking) == {
        "role": "assistant",
        "reasoning_content": "still thinking",
        "content": "",
    }
    call = [t["tool_call_begin"], *encode("functions.search:3"), t["tool_call_argument"], *encode('{"q": 1}')]
    complete = [t["think_begin"], t["think_end"], t["tool_calls_begin"], *call, t["tool_call_end"]]
    parsed = renderer.parse_assistant(complete + call)  # the second call was cut off
    assert parsed["tool_calls"] == [
        {
            "id": "functions.search:3",
            "type": "function",
            "function": {"name": "search", "arguments": '{"q": 1}'},
        }
    ]
    garbled = [t["tool_calls_begin"], t["tool_call_begin"], *encode("oops"), t["tool_call_argument"]]
    garbled += [*encode("{}"), t["tool_call_end"], t["tool_calls_end"]]
    assert renderer.parse_assistant(garbled)["tool_calls"][0]["function"]["name"] == "oops"
    no_id = [t["tool_calls_begin"], t["tool_call_begin"], t["tool_call_argument"], *encode("{}")]
    no_id += [t["tool_call_end"], *call, t["tool_call_end"], t["tool_calls_end"]]
    assert [c["id"] for c in renderer.parse_assistant(no_id)["tool_calls"]] == ["functions.search:3"]
    alone = [t["tool_calls_begin"], t["tool_call_begin"], t["tool_call_argument"], *encode("{}")]
    assert "tool_calls" not in renderer.parse_assistant(alone + [t["tool_call_end"], t["tool_calls_end"]])
    trailing = [t["think_begin"], t["think_end"], *encode("done"), t["end_of_turn"], *encode("junk")]
    assert renderer.parse_assistant(trailing)["content"] == "done"


def test_stop_tokens_end_both_kinds_of_turn(renderer, conversation):
    call_turn, answer_turn = conversation[2], conversation[4]
    assert renderer.render_assistant(call_turn)[-1] == renderer.tool_calls_end_id
    assert renderer.render_assistant(answer_turn)[-1] == renderer.end_of_turn_id
    assert renderer.stop_token_ids == [renderer.end_of_turn_id, renderer.tool_calls_end_id]


def test_render_errors_name_the_message(renderer):
    with pytest.raises(ValueError, match="message 1: unknown role 'robot'"):
        renderer.render([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match="message 0: a tool message needs the tool_call_id"):
        renderer.render([{"role": "tool", "content": "5"}])
    with pytest.raises(ValueError, match="assistant message at index 0"):
        renderer.render_tool_results([{"role": "assistant", "content": "x"}])


def _foreign_tokenizer(directory) -> None:
    """A word-level tokenizer that has never heard of K3, saved as a Hugging Face directory."""
    model = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.train_from_iterator(
        ["what is two plus three", "it is five"], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]").save_pretrained(str(directory))


def test_any_tokenizer_is_given_the_k3_tokens_and_template(tmp_path, conversation, calculator_schema):
    _foreign_tokenizer(tmp_path)
    raw = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="load_tokenizer"):
        ChatRenderer(raw)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == len(raw) + len(SPECIAL_TOKENS)
    assert tokenizer.pad_token == SPECIAL_TOKENS["pad"]
    renderer = ChatRenderer(tokenizer)
    ids, mask = renderer.render(conversation, [calculator_schema], "high")
    out = tokenizer.apply_chat_template(
        conversation,
        tools=[calculator_schema],
        effort="high",
        tokenize=True,
        return_assistant_tokens_mask=True,
    )
    assert out["input_ids"] == ids
    assert out["assistant_masks"] == mask
