"""Stage files: every user mistake is exit 2 with file:line: key: problem (hint), and nothing is
written; matrices expand; overrides follow the documented targeting rules."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from orchestration_support import REPO
from safetensors.numpy import save_file

from orchestration.pipeline import config_hash, load_pipeline
from posttrain.config.errors import ConfigError, did_you_mean

HEADER = """
    kind: toy-sum
    plugins: ["{toy}"]
"""


def assert_user_error(result: tuple[int, str, str], *fragments: str) -> str:
    code, out, err = result
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    assert "Value error, " not in err, err  # pydantic's prefix to a validator's message
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    return err


@pytest.mark.parametrize(
    ("word", "hint"),
    [
        ("general/zzz", ""),  # only 'general/' in common: no suggestion
        ("general/lookpu", "did you mean 'general/lookup'?"),
        ("train.lx", "did you mean 'train.lr'?"),
        ("train.stpes", "did you mean 'train.steps'?"),
        ("stf", "did you mean 'sft'?"),
    ],
)
def test_did_you_mean_needs_the_part_after_a_shared_prefix_to_be_close(word: str, hint: str) -> None:
    names = ["general/visual", "general/lookup", "train.lr", "train.steps", "rollout.steps", "sft"]
    assert did_you_mean(word, names) == hint
    assert did_you_mean(word, []) == ""  # a stage with no needs has nothing to suggest


@pytest.mark.parametrize("command", ["run", "plan"])
def test_yaml_syntax_error_names_file_and_line(write, posttrain, tmp_path: Path, command: str) -> None:
    path = write(
        "a.yaml",
        HEADER,
        """
    value: 2
      train: 4
    """,
    )
    assert_user_error(
        posttrain(command, path, "--run-dir", tmp_path / "run"),
        "a.yaml:4:",
        "YAML syntax error",
        "mapping values are not allowed here",
    )
    assert not (tmp_path / "run").exists()


def test_misspelled_keys_suggest_the_nearest_valid_key(write, posttrain, tmp_path: Path) -> None:
    path = write(
        "a.yaml",
        HEADER,
        """
    valeu: 2
    train:
      lr: 0.5
      stpes: 3
    """,
    )
    err = assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:3: valeu: unknown key (did you mean 'value'?)",
        "a.yaml:6: train.stpes: unknown key (did you mean 'steps'?)",
    )
    assert "2 problems" in err
    assert not (tmp_path / "run").exists()


def test_misspelled_generic_key_is_caught_even_for_an_unregistered_kind(
    write, posttrain, tmp_path: Path
) -> None:
    write("b.yaml", HEADER)
    path = write(
        "a.yaml",
        """
    kind: not-registered-anywhere
    neds: [b.yaml]
    """,
    )
    assert_user_error(
        posttrain("plan", path, "--run-dir", tmp_path / "run"),
        "a.yaml:2: neds: unknown key (did you mean 'needs'?)",
    )


def test_missing_needs_file(write, posttrain, tmp_path: Path) -> None:
    write("base.yaml", HEADER)
    path = write(
        "a.yaml",
        HEADER,
        """
    needs: [bsae.yaml]
    """,
    )
    assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:3: needs[0]: stage file bsae.yaml does not exist",
        "did you mean 'base.yaml'?",
    )
    assert not (tmp_path / "run").exists()


def test_cycle_is_named(write, posttrain, tmp_path: Path) -> None:
    write("b.yaml", HEADER, "needs: [c.yaml]\n")
    write("c.yaml", HEADER, "needs: [a.yaml]\n")
    path = write("a.yaml", HEADER, "needs: [b.yaml]\n")
    err = assert_user_error(posttrain("run", path, "--run-dir", tmp_path / "run"), "needs form a cycle: ")
    cycle = err.split("needs form a cycle: ")[1].split(" (")[0].split(" -> ")
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["a", "b", "c"]
    assert not (tmp_path / "run").exists()


def test_wrong_types_name_key_line_and_value(write, posttrain, tmp_path: Path) -> None:
    path = write(
        "a.yaml",
        HEADER,
        """
    seed: abc
    train: {steps: many}
    """,
    )
    assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:3: seed: Input should be a valid integer",
        "'abc'",
        "a.yaml:4: train.steps: Input should be a valid integer",
        "'many'",
    )
    assert not (tmp_path / "run").exists()


def test_missing_model_preset_and_duplicate_key(write, posttrain, tmp_path: Path) -> None:
    write("models/tiny.yaml", "hidden_size: 64\n")
    path = write(
        "a.yaml",
        HEADER,
        """
    model: models/tinny.yaml
    value: 1
    value: 2
    """,
    )
    assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:3: model: model preset models/tinny.yaml does not exist",
        "did you mean 'tiny.yaml'?",
        "a.yaml:5: value: duplicate key (first written on line 4)",
    )


def test_the_content_of_a_model_preset_is_checked_when_the_file_is_read(
    write, posttrain, tmp_path: Path
) -> None:
    """Before: `plan` checked only that the preset existed, and a misspelt, mistyped or unparsable
    preset stopped the stage at its start, after its needs had run. Now each is a plan-time error
    at the stage's `model:` line, naming the preset and its key; nothing is written."""
    tiny = (REPO / "stages" / "models" / "tiny.yaml").read_text()
    presets = {
        "misspelt.yaml": (tiny.replace("num_experts:", "num_expert:"), "unknown key 'num_expert'"),
        "mistyped.yaml": (
            re.sub(r"(?m)^num_experts: .*$", "num_experts: many", tiny),
            "num_experts='many' is a str",
        ),
        "broken.yaml": ("hidden_size: [64\n", "not valid YAML"),
        "broken.json": ('{"hidden_size": 64', "not valid JSON"),
    }
    for name, (text, said) in presets.items():
        write(f"models/{name}", text)
        path = write(f"{name.replace('.', '_')}.yaml", HEADER, f"model: models/{name}\n")
        with pytest.raises(ConfigError) as caught:
            load_pipeline(path)
        (issue,) = caught.value.issues
        assert str(issue).startswith(f"{path}:3: model: model config {tmp_path / 'models' / name}: "), issue
        assert said in str(issue), issue
    assert_user_error(  # the command line says it the same way, and writes nothing
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "broken_json.yaml:3: model: ",
        "not valid JSON",
    )
    assert not (tmp_path / "run").exists()
    write("models/tiny.yaml", tiny)
    assert load_pipeline(write("ok.yaml", HEADER, "model: models/tiny.yaml\n")).stages["ok"].model


def test_keys_are_read_as_written_not_as_yaml_booleans_or_numbers(write, posttrain, tmp_path: Path) -> None:
    """YAML 1.1 reads `on:` as True, `~:` as None and `3:` as 3; such keys crashed the config hash
    (JSON cannot sort them beside names). Read as written, they are unknown keys at their lines."""
    path = write(
        "a.yaml",
        HEADER,
        """
    on: 1
    ~: 2
    3: 3
    """,
    )
    assert_user_error(
        posttrain("plan", path, "--run-dir", tmp_path / "run"),
        "a.yaml:3: on: unknown key",
        "a.yaml:4: ~: unknown key",
        "a.yaml:5: 3: unknown key",
    )


def test_qat_block_is_checked_by_the_qat_config(write, posttrain, tmp_path: Path) -> None:
    path = write(
        "a.yaml",
        HEADER,
        """
    qat:
      scheme: k4
      blok_size: 32
    """,
    )
    assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:4: qat.scheme: Input should be 'k3' or 'none' (got 'k4')",
        "a.yaml:5: qat.blok_size: unknown key (did you mean 'block_size'?)",
    )
    assert_user_error(
        posttrain("plan", write("b.yaml", HEADER, "qat: {scheme: k3}\n"), "qat.scheme=mxfp2"),
        "command line override 'qat.scheme=mxfp2': qat.scheme: Input should be 'k3' or 'none'",
    )


def test_model_names_a_need_or_a_preset(write, tmp_path: Path) -> None:
    write("base.yaml", HEADER)
    ok = load_pipeline(write("a.yaml", HEADER, "needs: [base.yaml]\nmodel: base\n"))
    assert ok.stages["a"].model == "base" and ok.stages["a"].model_is_input
    with pytest.raises(
        ConfigError, match=r"model 'bsae' is neither a preset file .* nor one of this stage's needs"
    ):
        load_pipeline(write("b.yaml", HEADER, "needs: [base.yaml]\nmodel: bsae\n"))


def test_missing_plugin_file(write, posttrain, tmp_path: Path) -> None:
    path = write(
        "a.yaml",
        """
    kind: toy-sum
    plugins: [my_stages.py]
    """,
    )
    assert_user_error(
        posttrain("plan", path), "a.yaml:2: plugins[0]: plug-in file my_stages.py does not exist"
    )


def test_plugins_by_module_name(write, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        "my_stage_kinds.py",
        """
    from posttrain.stages import stage_kind

    @stage_kind("toy-by-module-name")
    def run(ctx):
        return {}
    """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pipeline = load_pipeline(write("a.yaml", "kind: toy-by-module-name\nplugins: [my_stage_kinds]\n"))
    assert pipeline.stages["a"].registered and pipeline.stages["a"].plugins == ["my_stage_kinds"]
    with pytest.raises(
        ConfigError, match=r"plugins\[0\]: importing plug-in 'no_such_kinds' failed: ModuleNotFound"
    ):
        load_pipeline(write("b.yaml", "kind: x\nplugins: [no_such_kinds]\n"))


def test_unregistered_kind_plans_but_does_not_run(write, posttrain, tmp_path: Path) -> None:
    path = write("a.yaml", "kind: distill-v9\nteacher_temperature: 2\n")
    code, out, _ = posttrain("plan", path, "--run-dir", tmp_path / "run")
    assert code == 0
    assert "distill-v9*" in out and "pending" in out
    assert "kind 'distill-v9' is not registered" in out and "teacher_temperature" in out
    assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:1: kind: kind 'distill-v9' is not registered",
        "cannot run",
    )
    assert not (tmp_path / "run").exists()


def test_matrix_expands_with_typed_substitution(write) -> None:
    write("sft.yaml", HEADER)
    pipeline = load_pipeline(
        write(
            "rl.yaml",
            HEADER,
            """
    stage: rl-${domain}-${effort}
    needs: [sft.yaml]
    matrix:
      domain: [general, coding]
      effort: [low, max]
      scale: [3]
    value: ${scale}
    description: ${domain} at ${effort}
    """,
        )
    )
    assert list(pipeline.stages) == [
        "sft",
        "rl-general-low",
        "rl-general-max",
        "rl-coding-low",
        "rl-coding-max",
    ]
    stage = pipeline.stages["rl-coding-max"]
    assert stage.body["value"] == 3 and stage.description == "coding at max"
    assert stage.matrix == {"domain": "coding", "effort": "max", "scale": 3}
    assert stage.needs == ["sft"]


def test_matrix_names_are_substituted_in_keys_too(write, posttrain) -> None:
    """A per-value block (`environments: {${domain}: ...}` in an rl file) was left with the literal
    key, so the kind read no block for the domain and silently used its defaults."""
    per_domain = "matrix: {domain: [general, coding]}\ntrain:\n  ${domain}: 1\n"
    path = write("rl.yaml", HEADER, per_domain)
    assert_user_error(posttrain("plan", path), "train.general: unknown key", "train.coding: unknown key")
    clash = write("clash.yaml", HEADER, per_domain + "  general: 2\n")
    assert_user_error(
        posttrain("plan", clash),
        "clash.yaml:4: train: with domain=general two keys of train become 'general'",
    )


def test_a_matrix_name_in_a_file_without_a_matrix_is_an_error(write, posttrain, tmp_path: Path) -> None:
    path = write("a.yaml", HEADER, 'fail_message: "effort ${effort}"\n')
    assert_user_error(
        posttrain("run", path, "--run-dir", tmp_path / "run"),
        "a.yaml:3: fail_message: ${effort} is used but this file has no matrix:",
    )
    assert not (tmp_path / "run").exists()


def test_matrix_stage_id_must_use_every_name(write, posttrain) -> None:
    path = write(
        "rl.yaml",
        HEADER,
        """
    stage: rl-${domain}
    matrix: {domain: [a, b], effort: [low, max]}
    """,
    )
    assert_user_error(
        posttrain("plan", path),
        "rl.yaml:3: stage: a matrix stage id must use every matrix name with several values",
        "['effort'] unused",
    )


def test_overrides_target_stages_and_keys(write) -> None:
    write("a.yaml", HEADER, "train: {steps: 2}\n")
    write("b.yaml", HEADER, "needs: [a.yaml]\nmatrix: {effort: [low, max]}\n")
    path = write("c.yaml", HEADER, "needs: [b.yaml]\n")
    pipeline = load_pipeline(path, ["train.steps=7", "b-*.value=5", "c.seed=11", "a.train.lr=0.5"])
    steps = {sid: s.body.get("train", {}).get("steps") for sid, s in pipeline.stages.items()}
    assert steps == {"a": 7, "b-low": 7, "b-max": 7, "c": 7}  # every stage whose schema has train.steps
    assert [pipeline.stages[s].body.get("value") for s in ("a", "b-low", "b-max", "c")] == [None, 5, 5, None]
    assert pipeline.stages["c"].seed == 11 and pipeline.stages["a"].seed == 0
    assert pipeline.stages["a"].body["train"] == {"steps": 7, "lr": 0.5}
    base = load_pipeline(path)
    assert base.stages["c"].config_hash != pipeline.stages["c"].config_hash


def test_a_key_spelled_out_at_its_default_is_the_same_stage(write) -> None:
    """Before: the hash read the body as written, so adding `lr: 0.1` (the kind's default) to a
    finished stage's file reran it. Now the body is hashed as the kind validated it, defaults left
    out; a value that differs (or an int where the default is that float) still counts."""
    hashes = {}
    for name, train in [
        ("short", "train: {steps: 2}"),
        ("spelled", "train: {steps: 2, lr: 0.1}\nvalue: 1"),
        ("other", "train: {steps: 2, lr: 0.2}"),
        ("default_steps", "train: {steps: 3}"),
        ("empty", "train: {}"),
    ]:
        hashes[name] = load_pipeline(write(f"{name}.yaml", HEADER, train + "\n")).stages[name].config_hash
    assert hashes["short"] == hashes["spelled"] != hashes["other"]
    assert hashes["default_steps"] == hashes["empty"] != hashes["short"]


def test_a_qat_key_spelled_out_at_its_default_is_the_same_stage(write) -> None:
    """Before: `qat:` was hashed as written, so spelling out `block_size: 32` beside `scheme: k3`
    reran a finished stage. Now it is hashed as QATConfig reads it, defaults left out but its
    scheme kept, so `{scheme: k3}` (every shipped stage file) hashes as it did before."""
    hashes = {}
    for name, qat in [
        ("short", "{scheme: k3}"),
        ("spelled", "{scheme: k3, block_size: 32, weight_scale_rule: floor}"),
        ("unset", "{}"),  # the default scheme, k3
        ("rule", "{scheme: k3, weight_scale_rule: rceil}"),
        ("off", "{scheme: none}"),
    ]:
        stage = load_pipeline(write(f"{name}.yaml", HEADER, f"qat: {qat}\n")).stages[name]
        hashes[name] = stage.config_hash
    assert hashes["short"] == hashes["spelled"] == hashes["unset"]
    assert len({hashes["short"], hashes["rule"], hashes["off"]}) == 3
    assert stage.qat == {"scheme": "none"}  # the stage still gets its block as written
    as_written = load_pipeline(write("written.yaml", HEADER, "qat: {scheme: k3}\n")).stages["written"]
    assert as_written.config_hash == config_hash(as_written, {}, {"scheme": "k3"})


def test_bad_overrides_are_user_errors(write, posttrain, tmp_path: Path) -> None:
    path = write("a.yaml", HEADER, "train: {steps: 2}\n")
    assert_user_error(
        posttrain("run", path, "train.stpes=3", "--run-dir", tmp_path / "run"),
        "command line: train.stpes=3: no stage has this key (did you mean 'train.steps'?)",
    )
    assert_user_error(
        posttrain("run", path, "train.steps=lots", "--run-dir", tmp_path / "run"),
        "command line override 'train.steps=lots': train.steps: Input should be a valid integer",
    )
    assert_user_error(
        posttrain("run", path, "needs=[]", "--run-dir", tmp_path / "run"),
        "'needs' shapes the stage DAG and cannot be overridden",
    )
    assert_user_error(
        posttrain("run", path, "steps", "--run-dir", tmp_path / "run"), "cannot read override 'steps'"
    )
    assert not (tmp_path / "run").exists()


def test_overrides_reach_the_named_entries_of_a_mapping() -> None:
    """`environments.general.max_turns=2` sets the entry in every stage whose file has it; a new
    entry needs a stage prefix and the error names it. Before, the schema paths skipped the entry's
    name: the first was refused as "no stage has environments.general yet" (both files have it),
    `teachers.coding-max.model` got "did you mean 'teachers.model'?" and `environments.max_turns`
    reached the stages as a domain named max_turns."""
    pipeline = load_pipeline(REPO / "stages" / "mopd.yaml", ["environments.general.max_turns=2"])
    changed = [s for s in pipeline.stages.values() if s.kind in ("rl", "mopd")]
    assert len(changed) == 10 and all(s.body["environments"]["general"]["max_turns"] == 2 for s in changed)
    for override, message in [
        (
            "teachers.coding-max.model=sft",
            "no stage has teachers.coding-max yet; add it per stage: mopd.teachers.coding-max.model=sft",
        ),
        (
            "eval.subsets.hard.prompts=8",
            "add it per stage: rl-general-low.eval.subsets.hard.prompts=8 (a glob such as 'rl-*' targets",
        ),
        ("environments.max_turns=3", "environments.max_turns=3: no stage has this key"),
    ]:
        with pytest.raises(ConfigError) as error:
            load_pipeline(REPO / "stages" / "mopd.yaml", [override])
        assert message in str(error.value)


def test_a_nan_under_a_bound_is_one_problem() -> None:
    # Before: also "Input should be greater than 0 (got nan)" from the schema's bound, for one key.
    with pytest.raises(ConfigError) as error:
        load_pipeline(REPO / "stages" / "mopd.yaml", ["mopd.r_max=.nan"])
    (issue,) = error.value.issues
    assert str(issue) == "command line override 'mopd.r_max=.nan': r_max: must be a finite number, got nan"


def test_kind_config_must_forbid_unknown_keys() -> None:
    from pydantic import BaseModel

    from posttrain.stages import stage_kind

    class Loose(BaseModel):
        steps: int = 1

    with pytest.raises(TypeError, match="must set model_config = ConfigDict"):
        stage_kind("loose", config=Loose)


def test_shipped_pipeline_is_the_eleven_stage_dag() -> None:
    pipeline = load_pipeline(REPO / "stages" / "mopd.yaml")
    # effort-major, so the stages running side by side are of different domains
    rl = [f"rl-{d}-{e}" for e in ("low", "high", "max") for d in ("general", "agent", "coding")]
    assert list(pipeline.stages) == ["sft", *rl, "mopd"]
    # MOPD's student is the SFT model and its teachers the nine specialists: all of them are needs.
    assert pipeline.stages["mopd"].needs == ["sft", *rl]
    assert pipeline.stages["mopd"].body["student"] == "sft"
    assert all(pipeline.stages[s].needs == ["sft"] and pipeline.stages[s].body["init"] == "sft" for s in rl)
    assert pipeline.stages["rl-agent-max"].matrix == {"domain": "agent", "effort": "max"}
    # sft continues the shipped pretrained base; the others continue a need's checkpoint.
    assert pipeline.stages["sft"].model == str(REPO / "data_recipes" / "base")
    assert not pipeline.stages["sft"].model_is_input
    assert all(pipeline.stages[s].model is None for s in [*rl, "mopd"])
    for stage in pipeline.stages.values():
        assert stage.qat == {"scheme": "k3"}


@pytest.mark.parametrize(
    ("needs", "key", "message"),
    [
        (
            "[rl.yaml]",
            "student",
            "student 'sft' is neither one of this stage's needs (rl-general-low, rl-agent-low",
        ),
        (
            "[sft.yaml]",
            "teachers",
            "teacher of (domain 'general', effort 'low') 'rl-general-low' is neither one of this "
            "stage's needs (sft)",
        ),
    ],
)
def test_mopd_without_the_need_its_student_or_teachers_come_from_fails_plan(
    posttrain, tmp_path: Path, needs: str, key: str, message: str
) -> None:
    stages = tmp_path / "stages"
    shutil.copytree(REPO / "stages", stages)
    shipped = (stages / "mopd.yaml").read_text()
    assert "needs: [sft.yaml, rl.yaml]" in shipped
    (stages / "mopd.yaml").write_text(shipped.replace("needs: [sft.yaml, rl.yaml]", f"needs: {needs}"))
    # located at the key's line, or at line 1 when the key is left to its default (teachers)
    line = next((i for i, text in enumerate(shipped.splitlines(), 1) if text.startswith(f"{key}:")), 1)
    assert_user_error(
        posttrain("plan", stages / "mopd.yaml", "--run-dir", tmp_path / "run"),
        f"mopd.yaml:{line}: {key}: ",
        message,
    )
    assert not (tmp_path / "run").exists()


def test_a_model_directory_is_hashed_by_its_content(write, tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text('{"model_type": "kimi_k3"}')
    save_file({"w": np.ones(2, np.float32)}, str(base / "model.safetensors"))
    stage = write("sft.yaml", HEADER, "model: base\n")
    first = load_pipeline(stage).stages["sft"]
    assert first.model == str(base.resolve()) and not first.model_is_input
    save_file({"w": np.zeros(2, np.float32)}, str(base / "model.safetensors"))
    assert load_pipeline(stage).stages["sft"].config_hash != first.config_hash


def test_a_damaged_model_directory_is_refused_at_plan_time(write, tmp_path: Path, posttrain) -> None:
    # Before: only config.json was looked for; the stage failed when it started, with safetensors'
    # "header too small" naming no file.
    base = tmp_path / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text('{"model_type": "kimi_k3"}')
    (base / "model.safetensors").write_bytes(b"")  # a copy that stopped before its first byte
    stage = write("sft.yaml", HEADER, "model: base\n")
    line = stage.read_text().splitlines().index("model: base") + 1
    assert_user_error(
        posttrain("plan", stage, "--run-dir", tmp_path / "run"),
        f"sft.yaml:{line}: model: {base.resolve() / 'model.safetensors'} is not a readable safetensors file",
        "copy or export the checkpoint again",
    )


def test_mopd_plays_the_specialists_harness_so_their_accuracies_compare() -> None:
    """orchestration.outcomes reads how much of each specialist's accuracy the student keeps from
    the two stages' greedy evaluations: that needs the same environments and held-out prompts."""
    pipeline = load_pipeline(REPO / "stages" / "mopd.yaml")
    mopd, rl = pipeline.stages["mopd"].body, pipeline.stages["rl-general-low"].body
    assert mopd["environments"] == rl["environments"]
    assert mopd["eval"].get("seed", 0) == rl["eval"].get("seed", 0)  # both schemas default to 0
    assert mopd["eval"]["accuracy_prompts_per_domain"] <= rl["eval"]["prompts"]


@pytest.mark.parametrize(
    ("recipes", "message"),
    [
        ("{agent_sft: 0}", "agent_sft: weight must be a positive finite number, got 0.0"),
        ("{agent_sft: -1}", "agent_sft: weight must be a positive finite number, got -1.0"),
        ("{agent_sft: .inf}", "agent_sft: weight must be a positive finite number, got inf"),
        ("{agent_sft: .nan}", "agent_sft: weight must be a positive finite number, got nan"),
        ("{}", "no recipe: name at least one"),
        (
            "{agent_sft: 1, traces/mine.jsonl: 1, ./hub_copy:test: 1, /no/such/dir: 1}",
            "traces/mine.jsonl, ./hub_copy:test, /no/such/dir: no such file or directory (relative "
            "paths are read from the directory `posttrain run` is started in",
        ),
        ("{agent_sfx: 1}", "unknown data recipe 'agent_sfx'; did you mean 'agent_sft'?"),
    ],
)
def test_sft_recipe_weights_and_local_files_are_checked_by_plan(
    write, posttrain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipes: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write("sft.yaml", "kind: sft\ntrain: {steps: 1}\ndata:\n  recipes: ", recipes, "\n")
    assert_user_error(
        posttrain("plan", path, "--run-dir", tmp_path / "run"), "sft.yaml:4: data.recipes: ", message
    )


def test_sft_recipe_files_that_exist_plan(write, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative to the directory `posttrain run` starts in (not the stage file's); a hub id is only
    # known when it loads.
    monkeypatch.chdir(tmp_path)
    write("traces/mine.jsonl", "")
    write("hub_copy/data.jsonl", "")
    recipes = "{agent_sft: 1, traces/mine.jsonl: 2, ./hub_copy:test: 0.5, owner/name:train: 1}"
    pipeline = load_pipeline(
        write("stages/sft.yaml", "kind: sft\ntrain: {steps: 1}\ndata:\n  recipes: ", recipes, "\n")
    )
    assert list(pipeline.stages["sft"].body["data"]["recipes"]) == [
        "agent_sft",
        "traces/mine.jsonl",
        "./hub_copy:test",
        "owner/name:train",
    ]


def test_a_block_check_names_its_key_without_printing_the_block(tmp_path: Path) -> None:
    """A model or mapping validator's error (here: an rl stage's custom domain without budget usage
    counting, MOPD environments of domains it does not train) is located at the key to edit and
    does not repeat the whole block (it printed the stage's entire body after `got`)."""
    stages = tmp_path / "stages"
    shutil.copytree(REPO / "stages", stages)
    rl = stages / "rl.yaml"  # math: a domain a plug-in registers, its budget usage not given
    plugin = f"plugins: ['{REPO / 'examples' / 'math_domain.py'}']\n"
    rl.write_text(rl.read_text().replace("needs: [sft.yaml]\n", "needs: [sft.yaml]\n" + plugin))
    budget_line = rl.read_text().splitlines().index("budget:") + 1
    with pytest.raises(ConfigError) as caught:
        load_pipeline(stages / "mopd.yaml", ["rl-general-low.domain=math", "mopd.domains=[general]"])
    messages = [str(issue) for issue in caught.value.issues]
    assert any(
        m.startswith(f"{stages / 'rl.yaml'}:{budget_line}: budget: ")
        and "domain 'math' has no budget usage counting" in m
        for m in messages
    ), messages
    assert any("environments: " in m and "['agent', 'coding'] are not in `domains`" in m for m in messages)
    assert not any("(got {" in m for m in messages), messages


def test_a_prompt_count_the_families_cannot_meet_is_refused_when_the_file_is_read(tmp_path: Path) -> None:
    """Before: rl and mopd stages drew their prompts at their start, so a count their task families
    cannot meet failed after their needs had run (the SFT, or the nine specialists). Now each makes
    its own draws (`draw_prompts`) when its stage file is read, the error at the key that asked."""
    one_family = "rl-coding-high.environments.coding.families=[coding/fix_function]"  # 165 questions
    with pytest.raises(ConfigError) as caught:  # 96 of them held out
        load_pipeline(REPO / "stages" / "mopd.yaml", [one_family, "rl-coding-high.rollout.prompts=100"])
    (issue,) = caught.value.issues
    assert str(issue) == (
        "command line override 'rl-coding-high.rollout.prompts=100': rollout.prompts: coding: only 69 "
        "distinct train prompts could be drawn from ['coding/fix_function'] (the last 1650 draws brought "
        "no new one, besides the 96 excluded), 100 were asked for; lower rollout.prompts to at most 69 "
        "(got 100)"
    )
    load_pipeline(REPO / "stages" / "mopd.yaml", [one_family, "rl-coding-high.rollout.prompts=69"])  # plans

    stages = tmp_path / "stages"  # set in the file: at the key's line, once for the three efforts
    shutil.copytree(REPO / "stages", stages)
    rl = stages / "rl.yaml"
    rl.write_text(
        rl.read_text().replace(
            "    max_submissions: 1 ", "    families: [coding/fix_function]\n    max_submissions: 1 "
        )
    )
    line = next(
        i for i, text in enumerate(rl.read_text().splitlines(), 1) if text.startswith("  prompts: 128")
    )
    with pytest.raises(ConfigError) as caught:
        load_pipeline(stages / "mopd.yaml")
    (issue,) = [issue for issue in caught.value.issues if "rl.yaml" in str(issue)]  # and sft's base model
    assert str(issue).startswith(f"{rl}:{line}: rollout.prompts: coding: only 69 distinct train prompts"), (
        issue
    )


def test_mopd_counts_set_by_two_keys_are_refused_at_the_key_that_asked(tmp_path: Path) -> None:
    """MOPD's held-out count is the larger of two keys and its training count a product of two;
    before, a count its families could not meet was reported at the top of the file. Now at the
    override that set it, else at the key's line in the file."""
    one_family = "mopd.environments.coding.families=[coding/fix_function]"  # 165 questions
    said = "coding: only 165 distinct eval prompts could be drawn from ['coding/fix_function']"
    lower = "lower eval.prompts_per_domain and eval.accuracy_prompts_per_domain to at most 165"
    for counts, at in [
        (["mopd.eval.accuracy_prompts_per_domain=200"], "mopd.eval.accuracy_prompts_per_domain=200"),
        (["mopd.eval.prompts_per_domain=300"], "mopd.eval.prompts_per_domain=300"),
        # the one of the two over the families' count, not the other override
        (
            ["mopd.eval.prompts_per_domain=100", "mopd.eval.accuracy_prompts_per_domain=200"],
            "mopd.eval.accuracy_prompts_per_domain=200",
        ),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_pipeline(REPO / "stages" / "mopd.yaml", [one_family, *counts])
        (issue,) = caught.value.issues
        key = at.removeprefix("mopd.").split("=")[0]
        assert str(issue).startswith(f"command line override {at!r}: {key}: {said}"), issue
        assert lower in str(issue), issue

    train = "coding: only 69 distinct train prompts could be drawn"  # 96 of the 165 held out
    for override in ["mopd.rollout.prompts_per_domain=3", "mopd.train.steps=9"]:  # 96 and 72 asked
        with pytest.raises(ConfigError) as caught:
            load_pipeline(REPO / "stages" / "mopd.yaml", [one_family, override])
        (issue,) = caught.value.issues
        key = override.removeprefix("mopd.").split("=")[0]
        assert str(issue).startswith(f"command line override {override!r}: {key}: {train}"), issue
        assert "lower train.steps x rollout.prompts_per_domain to at most 69" in str(issue), issue

    stages = tmp_path / "stages"  # neither overridden: at the first key's line, said once
    shutil.copytree(REPO / "stages", stages)
    with pytest.raises(ConfigError) as caught:
        load_pipeline(stages / "mopd.yaml", [one_family])
    (issue,) = [issue for issue in caught.value.issues if "mopd.yaml" in str(issue)]  # and sft's base model
    line = next(
        i
        for i, text in enumerate((stages / "mopd.yaml").read_text().splitlines(), 1)
        if text.startswith("  steps: ")
    )
    assert str(issue).startswith(f"{stages / 'mopd.yaml'}:{line}: train.steps: {train}"), issue
