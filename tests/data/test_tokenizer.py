"""The shipped BPE: exactly 2048 tokens with the K3 special tokens first, lossless, digits one per
token, and rebuilt byte-for-byte by data_recipes/build_tokenizer.py."""

from __future__ import annotations

import json

from data_recipes.build_tokenizer import VOCAB_SIZE, build
from posttrain.data.chat import DEFAULT_TOKENIZER_DIR, SPECIAL_TOKENS


def test_vocab_is_exactly_the_tiny_models(tokenizer):
    assert VOCAB_SIZE == 2048
    assert len(tokenizer) == 2048
    assert tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True) == 2048
    assert max(tokenizer.get_vocab().values()) == 2047


def test_special_tokens_have_fixed_ids_and_never_split(tokenizer):
    for expected_id, token in enumerate(SPECIAL_TOKENS.values()):
        assert tokenizer.convert_tokens_to_ids(token) == expected_id
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False)[1:-1] == [expected_id]
    assert tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == SPECIAL_TOKENS["end_of_turn"]
    saved = json.loads((DEFAULT_TOKENIZER_DIR / "special_tokens_map.json").read_text())
    assert saved["eos_token"] == "<|im_end|>" and "<|effort_max|>" in saved["additional_special_tokens"]


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("total 90417 dollars", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("90417")


def test_lossless_on_every_shipped_text(tokenizer, shipped):
    for record in shipped:
        for message in record["messages"]:
            for text in (message.get("content"), message.get("reasoning_content")):
                if text:
                    ids = tokenizer.encode(text, add_special_tokens=False)
                    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text


def test_rebuild_gives_identical_files(tmp_path):
    build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_TOKENIZER_DIR / name).read_bytes(), name
