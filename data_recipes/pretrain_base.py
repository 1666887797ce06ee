"""Pretrain the tiny K3 base the default run's SFT starts from: `python -m data_recipes.pretrain_base`.

K3's post-training starts from a pretrained base, and so does ours. A tiny K3 trained from random
weights on a few hundred thousand SFT tokens never learns in-context copying (reading a name or a
number in the prompt or a tool result and writing it again), so it solves none of the shipped
tasks and RL has no signal. This script pretrains the `stages/models/small.yaml` architecture on a
synthetic corpus built only for that skill plus the shipped documents:

- span repetition ("Copy: w1 ... wk. Again: w1 ... wk."), the classic induction-head inducer;
- key-value recall in several phrasings ("Ana: 26. Ben: 14. Query Ben -> 14");
- numbers into expressions ("Numbers 12, 7 and 3 give 12*7+3");
- the shipped documents' sentences (what the agent tasks later search).

No task prompt, question template or answer of the task families is in the corpus, and no chat
markup: the SFT stage teaches the format. Loss is on every token. The output directory (config,
bf16 safetensors, tokenizer) is what `stages/sft.yaml` names as its model; the shipped copy in
`data_recipes/base/` was made by this script on the device named in its README.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch

from data_recipes.shipped import check_shipped_out, logged_arguments, replaced_dir

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "stages" / "models" / "small.yaml"
TOKENIZER = Path(__file__).resolve().parent / "tokenizer"
DOCS = Path(__file__).resolve().parent / "docs"
OUTPUT = Path(__file__).resolve().parent / "base"

NAMES = (
    "Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mia", "Noor",
    "Otto", "Pia", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Vic", "Wren", "Yara", "Zed",
)  # fmt: skip
RELATIONS = (
    ("{k}: {v}.", "Query {k} -> {v}."),
    ("{k} = {v};", "So {k} = {v}."),
    ("The value of {k} is {v}.", "Asked for {k}, the value is {v}."),
    ("{k} maps to {v}.", "Lookup {k}: {v}."),
)


def words() -> list[str]:
    """The shipped documents' words plus names, numbers and file names: what tasks make models copy."""
    text = " ".join(path.read_text() for path in sorted(DOCS.glob("*.txt")))
    pool = sorted(set(re.findall(r"[A-Za-z][A-Za-z'-]+", text)))
    return pool + list(NAMES) + [str(n) for n in range(1000)] + [f"{w}.txt" for w in ("notes", "data", "log")]


def document(rng: random.Random, pool: list[str], sentences: list[str]) -> str:
    """One corpus document of a random kind."""
    kind = rng.randrange(5)
    if kind == 0:
        span = " ".join(rng.choice(pool) for _ in range(rng.randint(3, 12)))
        return f"Copy: {span}. Again: {span}."
    if kind in (1, 2):
        stated, asked = rng.choice(RELATIONS)
        keys = rng.sample(pool if kind == 1 else list(NAMES), rng.randint(2, 6))
        values = [rng.choice(pool) for _ in keys]
        facts = " ".join(stated.format(k=k, v=v) for k, v in zip(keys, values, strict=True))
        queries = " ".join(
            asked.format(k=keys[i], v=values[i])
            for i in rng.sample(range(len(keys)), rng.randint(1, len(keys)))
        )
        return f"{facts} {queries}"
    if kind == 3:
        a, b, c = (rng.randint(2, 99) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        return f"Numbers {a}, {b} and {c} give {a}{op1}{b}{op2}{c}."
    start = rng.randrange(len(sentences))
    return " ".join(sentences[start : start + rng.randint(1, 4)])


def batches(tokenizer, seed: int, batch: int, length: int, eos: int):
    """Endless [batch, length] rows of packed documents, separated by the end-of-text token."""
    rng, pool = random.Random(f"pretrain:{seed}"), words()
    sentences = [
        s.strip() for path in sorted(DOCS.glob("*.txt")) for s in path.read_text().splitlines() if s.strip()
    ]
    buffer: list[int] = []
    while True:
        while len(buffer) < batch * length:
            # Encoded a few hundred at a time: the tokenizer's batch call, not Python, does the work.
            docs = [document(rng, pool, sentences) for _ in range(256)]
            for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
                buffer += ids + [eos]
        rows, buffer = buffer[: batch * length], buffer[batch * length :]
        yield torch.tensor(rows).view(batch, length)


@torch.no_grad()
def copy_nll(model, tokenizer, device: str, seed: int = 54321, n: int = 20) -> tuple[float, float]:
    """Mean per-token NLL of a random word span the first time it is read and when it is repeated:
    a base that copies in context has a far lower second number."""
    rng, pool, first, second = random.Random(f"copy-eval:{seed}"), words(), 0.0, 0.0
    for _ in range(n):
        span = " ".join(rng.choice(pool) for _ in range(8))
        head = tokenizer.encode(f"Copy: {span}. Again:", add_special_tokens=False)
        ids = tokenizer.encode(f"Copy: {span}. Again: {span}.", add_special_tokens=False)
        logp = model(input_ids=torch.tensor([ids], device=device)).logits[0].float().log_softmax(-1)
        nll = -logp[:-1].gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
        first += nll[2 : len(head) - 3].mean().item() / n  # the span's tokens, read the first time
        second += nll[len(head) - 1 :].mean().item() / n  # the same tokens, repeated
    return first, second


@torch.no_grad()
def recall_accuracy(model, tokenizer, device: str, seed: int = 12345, n: int = 100) -> float:
    """Share of held-out key-value queries whose value tokens (a number is one token per digit) are
    all the greedy next tokens."""
    rng, pool, hits = random.Random(f"recall-eval:{seed}"), words(), 0
    for _ in range(n):
        keys = rng.sample(list(NAMES), 4)
        values = [rng.choice(pool) for _ in keys]
        asked = rng.randrange(4)
        prefix = (
            " ".join(f"{k}: {v}." for k, v in zip(keys, values, strict=True)) + f" Query {keys[asked]} ->"
        )
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        # The value alone: a trailing "." is tokenized as ". " inside the corpus but "." at the end
        # of a string, so including it scored every correct recall as a miss.
        target = tokenizer.encode(prefix + f" {values[asked]}", add_special_tokens=False)[len(ids) :]
        full = torch.tensor([ids + target], device=device)
        predicted = model(input_ids=full).logits[0, len(ids) - 1 : -1].argmax(-1).tolist()
        hits += predicted == target
    return hits / n


def main() -> None:
    import posttrain.model as k3
    from posttrain.data.chat import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument(
        "--minutes", type=float, default=None, help="time budget: the schedule runs to its end by then"
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    # what made the shipped base, as its log recorded it (the device and the out dir change no weights)
    made_by = logged_arguments(OUTPUT / "pretrain_log.json")
    asked = {k: v for k, v in vars(args).items() if k not in ("out", "device")}
    check_shipped_out(parser, args.out, OUTPUT, asked, {k: made_by.get(k) for k in asked})

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(TOKENIZER)
    config = k3.load_model_config(PRESET)
    model = k3.KimiK3ForCausalLM(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = min(200, args.steps // 10)

    started = time.perf_counter()

    def progress(step: int) -> float:
        """How far through the run: by steps, or by the time budget when that is nearer its end,
        so a run stopped by --minutes has still annealed its learning rate."""
        by_steps = step / args.steps
        if args.minutes is None:
            return by_steps
        return max(by_steps, (time.perf_counter() - started) / 60 / args.minutes)

    def learning_rate(step: int, done_fraction: float) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done_fraction, 1.0))))

    eos = tokenizer.eos_token_id
    log: list[dict] = []
    data = batches(tokenizer, args.seed, args.batch, args.length, eos)
    print(
        f"pretraining {sum(p.numel() for p in model.parameters()):,} parameters on {args.device}", flush=True
    )
    step = 0
    for step in range(1, args.steps + 1):
        # Read once per step: with --minutes it follows the clock, and the schedule and the stop
        # test must agree on where the run is.
        done_fraction = progress(step)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, done_fraction)
        rows = next(data).to(args.device)
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        minutes = (time.perf_counter() - started) / 60
        done = done_fraction >= 1.0
        if step % 250 == 0 or step == 25 or done:
            model.eval()
            first, repeated = copy_nll(model, tokenizer, args.device)
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "copy_nll_first": round(first, 3),
                "copy_nll_repeated": round(repeated, 3),
                "recall": recall_accuracy(model, tokenizer, args.device),
            }
            model.train()
            entry["minutes"] = round(minutes, 2)
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if done:
            break
    with replaced_dir(args.out) as tmp:
        model.to("cpu", dtype=torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "pretrain_log.json").write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "steps": step, "log": log}, indent=1)
        )
    print(f"saved {args.out} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
