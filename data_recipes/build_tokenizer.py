"""Build the shipped tokenizer: `python -m data_recipes.build_tokenizer [--out DIR]`.

A byte-level BPE of exactly 2048 tokens (the tiny K3's vocab_size) trained with `tokenizers` on the
shipped trajectories, rendered through the K3 chat template, and the shipped documents. The K3
special tokens take ids 0..16; digits are split one per token so numbers tokenise the same wherever
they appear (a small model copies them between question, tool call and answer). Training sees the
text between special tokens in a fixed order with one thread, so a rebuild gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

# Before tokenizers starts its thread pool: one thread makes the training order fixed.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

from posttrain.data.chat import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

ROOT = Path(__file__).resolve().parent
VOCAB_SIZE = 2048
DATA_FILES = (ROOT / "data" / "agent_sft.jsonl",)
DOCS_DIR = ROOT / "docs"
OUTPUT_DIR = ROOT / "tokenizer"
_SPECIAL_SPLIT = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS.values()))


def training_texts() -> Iterator[str]:
    """The pieces of text between special tokens, in file order: what the BPE ever has to encode."""
    for path in DATA_FILES:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rendered = render_jinja_template(
                conversations=[record["messages"]],
                tools=record.get("tools") or None,
                chat_template=CHAT_TEMPLATE,
                effort=record.get("effort"),
            )[0][0]
            yield from (piece for piece in _SPECIAL_SPLIT.split(rendered) if piece)
    for path in sorted(DOCS_DIR.glob("*.txt")):
        yield path.read_text()


def build(output_dir: Path = OUTPUT_DIR) -> PreTrainedTokenizerFast:
    specials = list(SPECIAL_TOKENS.values())
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_texts(), trainer=trainer)
    if bpe.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"BPE reached {bpe.get_vocab_size()} tokens, not {VOCAB_SIZE}: the corpus is too small")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=SPECIAL_TOKENS["end_of_turn"],
        pad_token=SPECIAL_TOKENS["pad"],
        extra_special_tokens=[t for t in specials if t not in (SPECIAL_TOKENS["end_of_turn"], SPECIAL_TOKENS["pad"])],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where every reader looks.
    tokenizer.save_pretrained(str(output_dir), save_jinja_files=False)
    special_map = {**tokenizer.special_tokens_map, "additional_special_tokens": tokenizer.extra_special_tokens}
    (output_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args()
    tokenizer = build(args.out)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
