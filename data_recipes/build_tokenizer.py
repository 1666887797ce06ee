"""Build the shipped tokenizer: `python -m data_recipes.build_tokenizer [--out DIR]`.

A byte-level BPE of exactly 2048 tokens (the tiny K3's vocab_size) trained on shipped trajectories
(rendered through the K3 chat template; frozen, see CORPUS) and the shipped documents, in two stages
(SuperBPE): `tokenizers`' BPE inside words until every word of the corpus is one token (about 1600),
then merges across spaces of the most frequent neighbours up to 2048, so recurring phrases (system
prompts, tool declarations) cost few tokens while every word stays whole. The K3 special tokens take
ids 0..16; digits stay one per token so a number tokenises the same wherever it appears (a small
model copies numbers between question, tool call and answer). The text order is fixed and ties are
broken by the pair itself, so a rebuild gives the same files (the tests rebuild and compare).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.data.chat import CHAT_TEMPLATE, SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parent
VOCAB_SIZE = 2048
# The vocabulary is frozen: it was trained on the first 40 rows of eight families of the shipped
# trajectories as they were written then (rendered, split at special tokens: CORPUS), and the
# documents. The trajectories have changed since (general/lookup added; word answers written after a
# space, docs/rl.md); training on the frozen pieces keeps the shipped tokenizer and every model
# trained with it valid, and still rebuilds it byte for byte.
CORPUS = ROOT / "tokenizer" / "corpus.json.gz"
DOCS_DIR = ROOT / "docs"
OUTPUT_DIR = ROOT / "tokenizer"


def training_texts() -> Iterator[str]:
    """The pieces of text the BPE was trained on, in order: the frozen trajectory pieces (CORPUS),
    then the documents."""
    yield from json.loads(gzip.decompress(CORPUS.read_bytes()))
    for path in sorted(DOCS_DIR.glob("*.txt")):
        yield path.read_text()


def _digit_split(text: str) -> list[str]:
    """Digits become their own pieces in both stages, so no token ever holds a digit and more."""
    return [piece for piece, _ in pre_tokenizers.Digits(individual_digits=True).pre_tokenize_str(text)]


def train_words(texts: list[str]) -> Tokenizer:
    """Stage 1: ordinary byte-level BPE inside GPT-2 pre-tokens (words, punctuation runs)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def train_superwords(words: Tokenizer, texts: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Stage 2 (SuperBPE, Liu et al. 2025): once every word of the corpus is one token, keep merging
    the most frequent adjacent tokens across spaces until VOCAB_SIZE; ties go to the smallest pair.
    Returns the full vocab and merges (stage 1's first)."""
    vocab = dict(words.get_vocab())
    merges = [tuple(merge) for merge in json.loads(words.to_str())["model"]["merges"]]
    units = Counter(unit for text in texts for unit in _digit_split(text) if not unit.isdigit())
    sequences = [
        (words.encode(unit, add_special_tokens=False).tokens, count) for unit, count in sorted(units.items())
    ]
    while len(vocab) < VOCAB_SIZE:
        pairs: Counter[tuple[str, str]] = Counter()
        for tokens, count in sequences:
            for pair in zip(tokens, tokens[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            raise RuntimeError(f"the corpus ran out of pairs at {len(vocab)} tokens, short of {VOCAB_SIZE}")
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = best[0] + best[1]
        merges.append(best)
        vocab.setdefault(merged, len(vocab))
        sequences = [(_merge(tokens, best, merged), count) for tokens, count in sequences]
    return vocab, merges


def _merge(tokens: list[str], pair: tuple[str, str], merged: str) -> list[str]:
    if pair[0] not in tokens:
        return tokens
    out: list[str] = []
    index = 0
    while index < len(tokens):
        if index + 1 < len(tokens) and (tokens[index], tokens[index + 1]) == pair:
            out.append(merged)
            index += 2
        else:
            out.append(tokens[index])
            index += 1
    return out


def build(output_dir: Path = OUTPUT_DIR) -> PreTrainedTokenizerFast:
    texts = list(training_texts())
    vocab, merges = train_superwords(train_words(texts), texts)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # No word pre-tokenizer: superword merges span spaces. Digits still split one per token.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = list(SPECIAL_TOKENS.values())
    bpe.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=SPECIAL_TOKENS["end_of_turn"],
        pad_token=SPECIAL_TOKENS["pad"],
        extra_special_tokens=[
            t for t in specials if t not in (SPECIAL_TOKENS["end_of_turn"], SPECIAL_TOKENS["pad"])
        ],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    if len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} tokens, not {VOCAB_SIZE}")
    output_dir.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where every reader looks.
    tokenizer.save_pretrained(str(output_dir), save_jinja_files=False)
    special_map = {
        **tokenizer.special_tokens_map,
        "additional_special_tokens": tokenizer.extra_special_tokens,
    }
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
