"""The shipped tiny K3 base and the script that made it: the corpus teaches copying and holds no
task prompt, the script writes a loadable base, and the shipped base really copies in context."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import posttrain.model as k3
from data_recipes import pretrain_base
from posttrain.data.chat import load_tokenizer

SHIPPED = pretrain_base.OUTPUT


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    rng, pool = random.Random("corpus-test"), pretrain_base.words()
    sentences = ["Dana Ruiz works in the Logistics team at the Oslo office."]
    return [pretrain_base.document(rng, pool, sentences) for _ in range(600)]


def test_repetition_documents_repeat_their_span_exactly(corpus):
    spans = [doc for doc in corpus if doc.startswith("Copy: ")]
    assert len(spans) > 60
    for doc in spans:
        first, again = doc[len("Copy: ") : -1].split(". Again: ")
        assert first == again and 3 <= len(first.split()) <= 12


def test_recall_queries_restate_a_stated_fact(corpus):
    checked = 0
    for doc in corpus:
        if "Query " not in doc:
            continue
        facts = dict(part.split(": ", 1) for part in doc.split(" Query ")[0].rstrip(".").split(". "))
        for query in doc.split(" Query ")[1:]:
            key, value = query.rstrip(".").split(" -> ")
            assert facts[key] == value
            checked += 1
    assert checked > 20


def test_corpus_holds_no_task_prompt_or_chat_markup(corpus):
    text = " ".join(corpus)
    for phrase in ("How old is", "How many books", "Who is the", "chemical symbol", "Save the", "<|im_"):
        assert phrase not in text


def test_script_writes_a_loadable_base_of_the_small_preset(tmp_path, monkeypatch):
    """Written over an earlier base: that one's files go, its hand-written README.md stays (the
    script used to delete the shipped base's README with the rest)."""
    out = tmp_path / "base"
    out.mkdir()
    (out / "README.md").write_text("what this base is\n")
    (out / "stale.safetensors").write_text("an earlier save")
    argv = [
        "pretrain_base",
        "--steps",
        "2",
        "--batch",
        "1",
        "--length",
        "32",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    pretrain_base.main()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    preset = k3.load_model_config(pretrain_base.PRESET)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (
        preset.hidden_size,
        preset.num_hidden_layers,
    )
    assert json.loads((out / "pretrain_log.json").read_text())["steps"] == 2
    assert load_tokenizer(out).get_vocab() == load_tokenizer(pretrain_base.TOKENIZER).get_vocab()
    assert (out / "README.md").read_text() == "what this base is\n" and not (
        out / "stale.safetensors"
    ).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no temporary left beside it


def test_a_save_that_fails_leaves_the_old_base_whole(tmp_path):
    """A run killed (here: failing) while it saves leaves the base it was replacing as it was."""
    from data_recipes.shipped import replaced_dir

    out = tmp_path / "base"
    out.mkdir()
    (out / "model.safetensors").write_text("the shipped weights")
    with pytest.raises(OSError, match="disk full"), replaced_dir(out) as tmp:
        (tmp / "model.safetensors").write_text("half")
        raise OSError("disk full")
    assert [p.name for p in tmp_path.iterdir()] == ["base"]
    assert (out / "model.safetensors").read_text() == "the shipped weights"


def test_the_shipped_base_copies_a_span_it_has_read_and_random_weights_do_not():
    tokenizer = load_tokenizer(SHIPPED)
    base = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    first, repeated = pretrain_base.copy_nll(base, tokenizer, "cpu")
    assert repeated < 0.25 * first
    torch.manual_seed(0)
    fresh = k3.KimiK3ForCausalLM(k3.load_model_config(pretrain_base.PRESET)).eval()
    first, repeated = pretrain_base.copy_nll(fresh, tokenizer, "cpu")
    assert repeated > 0.9 * first


def test_the_shipped_base_recalls_most_stated_values_and_random_weights_none():
    tokenizer = load_tokenizer(SHIPPED)
    base = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    assert pretrain_base.recall_accuracy(base, tokenizer, "cpu", n=40) > 0.6  # 0.86 at n=100
    torch.manual_seed(0)
    fresh = k3.KimiK3ForCausalLM(k3.load_model_config(pretrain_base.PRESET)).eval()
    assert pretrain_base.recall_accuracy(fresh, tokenizer, "cpu", n=40) == 0.0


class Started(Exception):
    """Raised where pretraining would start: the arguments were let through."""


def test_other_arguments_do_not_overwrite_the_shipped_base(tmp_path, monkeypatch, capsys):
    # Before: --out defaults to the shipped base, which a trial with --steps 2 replaced.
    shipped = tmp_path / "base"
    shipped.mkdir()
    made_by = {"steps": 6000, "minutes": 5.2, "batch": 32, "length": 256, "lr": 0.003, "seed": 0}
    log = json.dumps({"args": made_by | {"device": "cuda", "out": "/elsewhere"}})
    (shipped / "pretrain_log.json").write_text(log)
    monkeypatch.setattr(pretrain_base, "OUTPUT", shipped)
    monkeypatch.setattr(sys, "argv", ["pretrain_base", "--steps", "2", "--device", "cpu"])
    with pytest.raises(SystemExit) as exit_:
        pretrain_base.main()
    error = capsys.readouterr().err
    assert (
        exit_.value.code == 2 and f"--steps 2 --minutes None would overwrite the shipped {shipped}" in error
    )
    assert [p.name for p in shipped.iterdir()] == ["pretrain_log.json"]
    # the README's command (on any device) is the one that made it: let through
    argv = ["pretrain_base", "--steps", "6000", "--minutes", "5.2", "--batch", "32", "--length", "256"]
    monkeypatch.setattr(sys, "argv", [*argv, "--device", "cpu"])

    def start(seed: int) -> None:
        raise Started

    monkeypatch.setattr(pretrain_base.torch, "manual_seed", start)
    with pytest.raises(Started):
        pretrain_base.main()
