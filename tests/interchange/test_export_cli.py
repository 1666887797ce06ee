"""`posttrain export` on bad input says what is wrong and writes nothing; on a tied, QAT-free K3 in
an old flat directory it writes shards plus an index above the shard size, unties the embeddings
(vLLM never ties `lm_head`), and the export loads back to the model's bf16 logits."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from posttrain.engines.testing import TINY_K3_PRESET, save_tiny_k3
from posttrain.model import KimiK3ForCausalLM, load_model_config

IDS = torch.randint(3, 2048, (1, 9), generator=torch.Generator().manual_seed(2))


def test_bad_input_names_the_problem_and_writes_nothing(tmp_path, posttrain, renderer):
    from posttrain.engines.testing import build_tiny_llama

    out = tmp_path / "out"
    code, _, err = posttrain("export", tmp_path / "nope", "--format", "bf16", "--out", out)
    assert code == 2 and "nope does not exist" in err
    stage = tmp_path / "run" / "sft"
    stage.mkdir(parents=True)
    (stage / "manifest.json").write_text("{}")
    code, _, err = posttrain("export", stage, "--format", "mxfp4", "--out", out)
    assert code == 2 and "stage dir without model/" in err
    llama = build_tiny_llama(tmp_path / "llama", renderer.tokenizer)
    code, _, err = posttrain("export", llama, "--format", "mxfp4", "--out", out)
    assert code == 2 and "LlamaForCausalLM, not a K3 model" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    code, _, err = posttrain("export", llama, "--format", "bf16", "--out", tmp_path / "full")
    assert code == 2 and "exists and is not an empty directory" in err
    code, _, err = posttrain("export", llama, "--format", "fp8", "--out", out)
    assert code == 2 and "invalid choice: 'fp8'" in err
    for size, problem in (("abc", "write a number and a unit"), ("0KB", "must be at least one byte")):
        code, _, err = posttrain("export", llama, "--format", "bf16", "--out", out, "--max-shard-size", size)
        assert code == 2 and f"argument --max-shard-size: '{size}': {problem}" in err
    (tmp_path / "afile").write_text("")
    for under_a_file in (tmp_path / "afile" / "sub", tmp_path / "afile" / "sub" / "deeper"):
        code, _, err = posttrain("export", llama, "--format", "bf16", "--out", under_a_file)
        assert (
            code == 2
            and f"{tmp_path / 'afile'} is a file, not a directory: choose an --out outside it" in err
        )
    (stage / "model").mkdir()
    (stage / "model" / "value.txt").write_text("5")  # a finished stage whose kind saved no HF model
    (stage / "manifest.json").write_text('{"status": "done"}')
    code, _, err = posttrain("export", stage, "--format", "bf16", "--out", out)
    assert code == 2 and "model has no config.json: not a Hugging Face model dir" in err
    # Before: an --out inside a stage's published model/ was written there, damaging that stage.
    code, _, err = posttrain("export", llama, "--format", "bf16", "--out", stage / "model" / "bf16")
    assert code == 2 and f"is inside the published model {stage / 'model'} of stage sft" in err
    assert not out.exists() and sorted(p.name for p in (stage / "model").iterdir()) == ["value.txt"]


def test_export_shards_and_unties_a_tied_flat_model(tmp_path, posttrain):
    config = load_model_config(TINY_K3_PRESET)
    config.tie_word_embeddings = True
    torch.manual_seed(5)
    model = KimiK3ForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path / "flat"))  # an old flat run dir's model
    args = ("--format", "bf16", "--out", tmp_path / "bf16", "--max-shard-size", "200KB")
    code, _, err = posttrain("export", tmp_path / "flat", *args)
    assert code == 0, err
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "language_model.lm_head.weight" in index["weight_map"]
    header = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert header["text_config"]["tie_word_embeddings"] is False
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    assert not loaded.config.tie_word_embeddings
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())  # what a bf16 export holds
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_a_stage_output_its_manifest_does_not_vouch_for_is_not_exported(tmp_path, posttrain, renderer):
    # Before: export read RUN_DIR/STAGE/model/ whatever its manifest said, and wrote it out.
    from orchestration.rundir import write_manifest
    from posttrain.files import hash_tree

    stage = tmp_path / "run" / "sft"
    stage.mkdir(parents=True)
    model = save_tiny_k3(stage / "model", renderer.tokenizer)
    files, digest = hash_tree(model)
    write_manifest(stage, {"status": "done", "model_files": files, "model_hash": digest})
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4] ^= 0xFF  # a flipped bit in the last weight: the header still reads
    weights.write_bytes(bytes(data))
    code, _, err = posttrain("export", stage, "--format", "bf16", "--out", tmp_path / "out")
    message = " ".join(err.split())
    assert code == 2 and "model/model.safetensors is damaged (its sha256 differs" in message
    assert "train it again with `posttrain run FILE --restart sft`" in message
    # killed between publishing model/ and recording it: the manifest still says running
    write_manifest(stage, {"status": "running"})
    code, _, err = posttrain("export", stage, "--format", "bf16", "--out", tmp_path / "out")
    assert code == 2 and "its manifest says the stage is 'running', not done" in " ".join(err.split())
    assert not (tmp_path / "out").exists()


def test_a_damaged_tokenizer_is_a_user_error_before_the_model_loads(tmp_path, posttrain, renderer):
    # Before: AutoTokenizer's JSONDecodeError escaped as a traceback, after the whole model loaded.
    model = save_tiny_k3(tmp_path / "model", renderer.tokenizer)
    (model / "tokenizer.json").write_text('{"version": "1.0", "truncated')
    code, _, err = posttrain("export", model, "--format", "bf16", "--out", tmp_path / "out")
    message = " ".join(err.split())
    assert code == 2 and "Traceback" not in err, err
    assert f"posttrain export: {model}: cannot load its tokenizer (" in message
    assert "copy tokenizer.json and tokenizer_config.json again" in message
    assert not (tmp_path / "out").exists()
