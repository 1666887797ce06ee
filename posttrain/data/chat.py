"""K3 chat rendering: OpenAI-style messages -> token ids and a loss mask, in one pass.

Every stage renders through this one class so that a trajectory is tokenised the same way when it is
trained on (SFT), sampled (RL engines stop on `end_of_turn_id` / `tool_calls_end_id` and append
`render_tool_results`), and prefilled by a teacher (MOPD). The exact-prefix rule holds by
construction: each message renders independently of what follows it, so
``render(messages[:k] + [assistant])`` is ``render_prompt(messages[:k])`` followed by the assistant's
tokens, and a sampled history is never re-tokenised differently.

The Jinja twin of this renderer (``chat_template.jinja``) ships inside the tokenizer, so
``tokenizer.apply_chat_template`` gives the same ids; its ``{% generation %}`` spans give the same
loss mask through ``return_assistant_tokens_mask=True``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator

from posttrain.data.chat_media import MEDIA_PART_TYPES, MEDIA_TOKENS, MediaCursor
from posttrain.data.sample import EFFORTS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from posttrain.data.images import MediaBlock, MediaItem, MoonViTImageProcessor

# Role headers are <|im_role|> ... <|im_middle|>, the K2 chat format's names.
# Ids follow this order (the shipped tokenizer gives them ids 0..16): pad first, so a model config's
# pad_token_id 0 is the tokenizer's pad.
SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|pad|>",
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
    "tool": "<|im_tool|>",
    "middle": "<|im_middle|>",
    "end_of_turn": "<|im_end|>",
    "think_begin": "<think>",
    "think_end": "</think>",
    "tool_calls_begin": "<|tool_calls_section_begin|>",
    "tool_calls_end": "<|tool_calls_section_end|>",
    "tool_call_begin": "<|tool_call_begin|>",
    "tool_call_argument": "<|tool_call_argument_begin|>",
    "tool_call_end": "<|tool_call_end|>",
    "effort_low": "<|effort_low|>",
    "effort_high": "<|effort_high|>",
    "effort_max": "<|effort_max|>",
}
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
TOOL_DECLARE_NAME = "tool_declare"
CHAT_TEMPLATE: str = (Path(__file__).with_name("chat_template.jinja")).read_text()
# Found by path, not by import: posttrain never imports the data_recipes plug-in package by name.
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "data_recipes" / "tokenizer"

_K2_CALL_ID = re.compile(r"^functions\.(?P<name>.+):(?P<index>\d+)$")


def tool_call_id(name: str, index: int) -> str:
    """The K2/K3 tool-call id the model itself writes: ``functions.<name>:<index in conversation>``."""
    return f"functions.{name}:{index}"


def tool_name_from_call_id(call_id: str) -> str:
    """Invert `tool_call_id`; an id the model garbled is returned whole so the tool lookup fails loudly."""
    match = _K2_CALL_ID.match(call_id)
    return match.group("name") if match else call_id


def check_tokenizer_dir(value: str | None) -> str | None:
    """A stage's `tokenizer:` key, checked when the stage file is read: a missing or misspelled dir
    passed `plan` and stopped the stage at its start with transformers' "Repo id must be in the form"
    error, which names neither the key nor the fix."""
    if value is not None and not (Path(value) / "tokenizer_config.json").is_file():
        raise ValueError(
            f"no tokenizer_config.json in that dir (relative to {Path.cwd()}); give the dir a "
            "tokenizer was saved to (save_pretrained), or null for the model dir's"
        )
    return value


# The `tokenizer:` key of the training kinds (a dir; null: the model's own, else the shipped one).
TokenizerDir = Annotated[str | None, AfterValidator(check_tokenizer_dir)]


def load_tokenizer(path: str | Path | None = None, *, media: bool = False) -> PreTrainedTokenizerFast:
    """Load a Hugging Face tokenizer directory (default: the shipped 2048-token BPE) speaking K3 chat.

    Any tokenizer works: K3 special tokens it lacks are added (so a model must resize its embeddings
    to ``len(tokenizer)``), ``<|pad|>`` becomes the pad token when it has none, and the K3 chat
    template replaces its own so ``apply_chat_template`` and `ChatRenderer` agree. ``media=True`` also
    adds the `MEDIA_TOKENS` a vision-language model's prompts need.
    """
    from transformers import AutoTokenizer  # here, not at import: transformers takes seconds to load

    if path is None and not DEFAULT_TOKENIZER_DIR.exists():
        raise FileNotFoundError(
            f"the shipped tokenizer {DEFAULT_TOKENIZER_DIR} is missing; rebuild it with "
            "`python data_recipes/build_tokenizer.py`"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path if path is not None else DEFAULT_TOKENIZER_DIR))
    vocab = tokenizer.get_vocab()
    wanted = [*SPECIAL_TOKENS.values(), *(MEDIA_TOKENS.values() if media else ())]
    missing = [token for token in wanted if token not in vocab]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = SPECIAL_TOKENS["pad"]
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_tokenizer_dir(model_dir: Path) -> Path | None:
    """The tokenizer a model dir was trained with, as every stage reads it: the dir's own, or None
    (the shipped one) for a dir saved without tokenizer files."""
    return model_dir if (model_dir / "tokenizer_config.json").is_file() else None


# The files a tokenizer dir is loaded from (fast and slow tokenizers, added and special tokens).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_files(path: Path | None) -> dict[str, str]:
    """File name -> sha256 of the TOKENIZER_FILES a tokenizer dir holds (None: the shipped one).
    Two dirs with equal digests load as the same tokenizer, which is cheap to know: loading one of
    K3's size and reading its ids (`TokenIds`) takes seconds."""
    from posttrain.files import sha256_file

    directory = path if path is not None else DEFAULT_TOKENIZER_DIR
    return {name: sha256_file(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()}


@dataclass(frozen=True)
class TokenIds:
    """What gives a tokenizer's ids their meaning, as loaded: its length, the vocabulary with the
    added tokens (token -> id) and the BPE merges (how text splits into those ids; None for a
    model without merges). Read once per tokenizer (`TokenIds.of`): at K3's 163k tokens reading
    them takes over a second, and MOPD compares one student with up to nine teachers."""

    length: int
    vocab: dict[str, int]
    merges: list | None

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerFast) -> TokenIds:
        # The merges from the serialised model, not the tokenizer.json file, so two files that
        # differ only in formatting or key order read alike.
        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"].get("merges")
        return cls(len(tokenizer), tokenizer.get_vocab(), merges)


def token_ids_difference(ours: TokenIds, theirs: TokenIds) -> str:
    """'' when the two tokenizers give every token id the same meaning; else their first
    difference, in words: the length, the first id whose token differs, or the merges."""
    if ours.length != theirs.length:
        return f"{ours.length} tokens against {theirs.length}"
    if ours.vocab != theirs.vocab:
        our_tokens = {i: token for token, i in ours.vocab.items()}
        their_tokens = {i: token for token, i in theirs.vocab.items()}
        ids = our_tokens.keys() | their_tokens.keys()
        first = min(i for i in ids if our_tokens.get(i) != their_tokens.get(i))
        return f"id {first} is {our_tokens.get(first)!r} against {their_tokens.get(first)!r}"
    if ours.merges != theirs.merges:
        return "the same vocabulary with other BPE merges (a text splits into other ids)"
    return ""


class ChatRenderer:
    """Render and parse K3 chat for one tokenizer.

    ids / loss masks: 1 on every assistant token after its header (thinking, content, tool calls and
    the end-of-turn token, which is ``<|tool_calls_section_end|>`` for a turn that calls tools), 0 on
    system, user, tool-result and header tokens.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, processor: MoonViTImageProcessor | None = None
    ) -> None:
        vocab = tokenizer.get_vocab()
        missing = [token for token in SPECIAL_TOKENS.values() if token not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} lacks the K3 special tokens {missing}; "
                "load it with posttrain.data.chat.load_tokenizer(path), which adds them"
            )
        self.tokenizer = tokenizer
        self.token_ids: dict[str, int] = {name: vocab[token] for name, token in SPECIAL_TOKENS.items()}
        self.end_of_turn_id = self.token_ids["end_of_turn"]
        self.tool_calls_end_id = self.token_ids["tool_calls_end"]
        self.pad_id = self.token_ids["pad"]
        self.assistant_header: list[int] = [self.token_ids["assistant"], self.token_ids["middle"]]
        self.media_token_ids: dict[str, int] = {
            name: vocab[token] for name, token in MEDIA_TOKENS.items() if token in vocab
        }
        self._tool_declare_ids = self.encode(TOOL_DECLARE_NAME)
        # The image processor of the model's vision tower (None: a text model, no media to size).
        self.processor = processor

    def media_blocks(self, images: Sequence[MediaItem]) -> list[list[MediaBlock]] | None:
        """`render`'s media argument for a Sample's images: None when there are none, else the
        processor's blocks (an error naming the fix when the renderer has no processor)."""
        if not images:
            return None
        if self.processor is None:
            raise ValueError(
                f"{len(images)} media entries to render but this renderer has no image processor: the "
                "model has no vision tower; give the stage a `vision:` preset or a vision-language model"
            )
        return self.processor.blocks(images)

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens an engine stops on: a final answer or a block of tool calls."""
        return [self.end_of_turn_id, self.tool_calls_end_id]

    def encode(self, text: str) -> list[int]:
        """Ids of plain text. Every text piece sits between special tokens, so encoding pieces one by
        one gives the same ids as encoding the whole rendered string (what apply_chat_template does)."""
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # Rendering -----------------------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        effort: str | None = None,
        media: Sequence[Sequence[MediaBlock]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Whole conversation -> (ids, loss_mask), both len(ids).

        A message's content may be a list of parts ``{"type": "text", "text": ...}``, ``{"type":
        "image"}``, ``{"type": "video"}``; media parts take, in order, the entries of `media`
        (`MoonViTImageProcessor.blocks(sample.images)`: one block per image, one per video chunk).
        Media tokens are prompt (loss mask 0); assistant turns are text only.
        """
        cursor = MediaCursor(media)
        ids, mask = self._render_preamble(messages, tools, effort, cursor)
        start = 1 if messages and messages[0].get("role") == "system" else 0
        for index in range(start, len(messages)):
            turn_ids, turn_mask = self._render_message(messages[index], index, cursor)
            ids += turn_ids
            mask += turn_mask
        cursor.check_used()
        return ids, mask

    def render_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        effort: str | None = None,
        media: Sequence[Sequence[MediaBlock]] | None = None,
    ) -> list[int]:
        """Conversation so far + the assistant header: what a policy continues from."""
        ids, _ = self.render(messages, tools, effort, media)
        return ids + self.assistant_header

    def render_tool_results(
        self, messages: list[dict[str, Any]], media: Sequence[Sequence[MediaBlock]] | None = None
    ) -> list[int]:
        """Environment turns (tool results, or a user/system message) appended after a sampled tool
        call, followed by the next assistant header. All of it is prompt (loss mask 0). `media`:
        the blocks of these turns' media parts (a screenshot a tool returned), as in `render`."""
        ids: list[int] = []
        cursor = MediaCursor(media)
        for index, message in enumerate(messages):
            if message.get("role") == "assistant":
                raise ValueError(f"render_tool_results got an assistant message at index {index}")
            ids += self._render_message(message, index, cursor)[0]
        cursor.check_used()
        return ids + self.assistant_header

    def render_assistant(self, message: dict[str, Any]) -> list[int]:
        """The trained part of one assistant turn (everything after its header)."""
        ids = [self.token_ids["think_begin"]]
        ids += self.encode(message.get("reasoning_content") or "")
        ids.append(self.token_ids["think_end"])
        ids += self.encode(message.get("content") or "")
        calls = message.get("tool_calls") or []
        if not calls:
            return ids + [self.end_of_turn_id]
        ids.append(self.token_ids["tool_calls_begin"])
        for call in calls:
            arguments = call["function"]["arguments"]
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            ids.append(self.token_ids["tool_call_begin"])
            ids += self.encode(call["id"])
            ids.append(self.token_ids["tool_call_argument"])
            ids += self.encode(arguments)
            ids.append(self.token_ids["tool_call_end"])
        return ids + [self.tool_calls_end_id]

    def _render_preamble(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        effort: str | None,
        cursor: MediaCursor,
    ) -> tuple[list[int], list[int]]:
        if effort is not None and effort not in EFFORTS:
            raise ValueError(f"unknown effort {effort!r}; expected one of {', '.join(EFFORTS)}")
        effort_ids = [self.token_ids[f"effort_{effort}"]] if effort is not None else []
        ids: list[int] = []
        if messages and messages[0].get("role") == "system":
            ids += [self.token_ids["system"], *effort_ids, self.token_ids["middle"]]
            ids += self._render_content(messages[0].get("content"), 0, cursor) + [self.end_of_turn_id]
        elif effort_ids:
            ids += [self.token_ids["system"], *effort_ids, self.token_ids["middle"], self.end_of_turn_id]
        if tools:
            declared = json.dumps(tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
            ids += [self.token_ids["system"], *self._tool_declare_ids, self.token_ids["middle"]]
            ids += self.encode(declared) + [self.end_of_turn_id]
        return ids, [0] * len(ids)

    def _render_message(
        self, message: dict[str, Any], index: int, cursor: MediaCursor
    ) -> tuple[list[int], list[int]]:
        role = message.get("role")
        if role == "assistant":
            if isinstance(message.get("content"), list):
                raise ValueError(f"message {index}: assistant content is text; media parts go in other turns")
            body = self.render_assistant(message)
            return self.assistant_header + body, [0] * len(self.assistant_header) + [1] * len(body)
        if role in ("system", "user"):
            ids = [self.token_ids[role], self.token_ids["middle"]]
        elif role == "tool":
            if not message.get("tool_call_id"):
                raise ValueError(f"message {index}: a tool message needs the tool_call_id it answers")
            ids = [self.token_ids["tool"], *self.encode(message["tool_call_id"]), self.token_ids["middle"]]
        else:
            raise ValueError(f"message {index}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        ids += self._render_content(message.get("content"), index, cursor) + [self.end_of_turn_id]
        return ids, [0] * len(ids)

    def _render_content(self, content: str | list | None, index: int, cursor: MediaCursor) -> list[int]:
        """A message body: text as is; a list of parts with each media part as its media blocks.
        Adjacent text parts are encoded together, as the template's concatenated string is."""
        if content is None or isinstance(content, str):
            return self.encode(content or "")
        ids: list[int] = []
        text = ""
        for part in content:
            kind = part.get("type")
            if kind == "text":
                text += part.get("text") or ""
            elif kind in MEDIA_PART_TYPES:
                ids += self.encode(text)
                text = ""
                for block in cursor.take(kind, index):
                    ids += self._media_block_ids(block)
            else:
                raise ValueError(
                    f"message {index}: unknown content part type {kind!r}; expected text, image or video"
                )
        return ids + self.encode(text)

    def _media_block_ids(self, block: MediaBlock) -> list[int]:
        if len(self.media_token_ids) != len(MEDIA_TOKENS):
            raise ValueError(
                f"tokenizer {self.tokenizer.name_or_path!r} lacks the media tokens "
                f"{list(MEDIA_TOKENS.values())}; load it with "
                "posttrain.data.chat.load_tokenizer(path, media=True)"
            )
        t = self.media_token_ids
        header = self.encode(f"{block.kind} {block.width}x{block.height}")
        return [
            t["media_begin"],
            *header,
            t["media_content"],
            *[t["media_pad"]] * block.num_tokens,
            t["media_end"],
        ]

    # Parsing -------------------------------------------------------------------------------------

    def parse_assistant(self, ids: list[int]) -> dict[str, Any]:
        """Generated ids after an assistant header -> {"role", "reasoning_content", "content", and
        "tool_calls" when there are any}. Inverts `render_assistant`; tolerates output cut short
        (finish "length"): an unclosed think block is all reasoning, an unclosed call is dropped, and
        so is a call without an id (a tool message answers an id; sampled at temperature 1, one
        MOPD evaluation episode wrote the argument token straight after the call token).
        Tokens after the end of turn are ignored."""
        t = self.token_ids
        position = 0
        reasoning: list[int] = []
        if ids[:1] == [t["think_begin"]]:
            end = _index(ids, t["think_end"], 1)
            reasoning = ids[1:end]
            position = end + 1
        stop = {t["tool_calls_begin"], self.end_of_turn_id, self.tool_calls_end_id}
        end = next((i for i in range(position, len(ids)) if ids[i] in stop), len(ids))
        message: dict[str, Any] = {
            "role": "assistant",
            "reasoning_content": self.decode(reasoning),
            "content": self.decode(ids[position:end]),
        }
        if end < len(ids) and ids[end] == t["tool_calls_begin"]:
            calls = self._parse_tool_calls(ids, end + 1)
            if calls:
                message["tool_calls"] = calls
        return message

    def _parse_tool_calls(self, ids: list[int], position: int) -> list[dict[str, Any]]:
        t = self.token_ids
        calls: list[dict[str, Any]] = []
        while position < len(ids) and ids[position] == t["tool_call_begin"]:
            argument = _index(ids, t["tool_call_argument"], position + 1)
            end = _index(ids, t["tool_call_end"], argument + 1)
            if end >= len(ids):
                break
            call_id = self.decode(ids[position + 1 : argument])
            position = end + 1
            if not call_id:  # sampled without an id: no tool message could answer it, so no call
                continue
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": tool_name_from_call_id(call_id),
                        "arguments": self.decode(ids[argument + 1 : end]),
                    },
                }
            )
        return calls


def _index(ids: list[int], token: int, start: int) -> int:
    """Position of `token` at or after `start`, or len(ids) when absent."""
    try:
        return ids.index(token, start)
    except ValueError:
        return len(ids)
