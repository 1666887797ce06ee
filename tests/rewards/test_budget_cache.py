"""The b0 cache the `rl` stage keeps for the budget reward (posttrain.rewards.budget): entries
keyed by prompt content and cold-start config, shared by every run that opens the directory,
concurrent writers losing nothing, and a damaged file named with its fix."""

import json
import threading

import pytest

from posttrain.rewards.budget import BaseBudget, BudgetCache, prompt_hash


def test_cache_round_trip_keys_and_sharing(tmp_path):
    cold = {"policy": "runs/x/sft/model", "n": 8, "quantile": 0.5}
    digest = prompt_hash([{"role": "user", "content": "2+2?"}])
    budget = BaseBudget(120.0, 0.5, 8, 5, "successes")
    cache = BudgetCache(tmp_path)
    assert cache.get("gsm/17", digest, cold) is None
    cache.put("gsm/17", digest, cold, budget)
    other_run = BudgetCache(tmp_path)
    assert other_run.get("gsm/17", digest, cold) == budget
    assert other_run.get("gsm/17", digest, {**cold, "n": 16}) is None
    edited = prompt_hash([{"role": "user", "content": "2+3?"}])
    assert other_run.get("gsm/17", edited, cold) is None
    other_run.put("gsm/17", digest, {**cold, "n": 16}, BaseBudget(90.0, 0.5, 16, 0, "all"))
    assert cache.get("gsm/17", digest, cold) == budget
    path = cache.path_for("gsm/17")
    on_disk = json.loads(path.read_text())
    assert on_disk["prompt_id"] == "gsm/17" and len(on_disk["entries"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == [path.name]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_writers_lose_no_entry(tmp_path):
    digest = prompt_hash([{"role": "user", "content": "q"}])

    def writer(run: int) -> None:
        cache = BudgetCache(tmp_path)
        for n in range(15):
            cache.put("p", digest, {"run": run, "n": n}, BaseBudget(float(n), 0.5, n, n, "successes"))

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache = BudgetCache(tmp_path)
    assert len(json.loads(cache.path_for("p").read_text())["entries"]) == 45
    assert cache.get("p", digest, {"run": 2, "n": 14}).tokens == 14.0


def test_corrupt_cache_file_names_the_file(tmp_path):
    cache = BudgetCache(tmp_path)
    cache.path_for("p").write_text("{not json")
    with pytest.raises(ValueError, match=r"p-[0-9a-f]{12}\.json is not valid JSON.*delete it"):
        cache.get("p", "h", {})
    # a damaged disk's bytes, and JSON that is not the file's mapping: an AttributeError and a
    # UnicodeDecodeError that named no file
    for damaged, problem in ((b"\xff\xfe{", "is not valid JSON"), (b"[1, 2]", "holds a list, not a mapping")):
        cache.path_for("p").write_bytes(damaged)
        with pytest.raises(ValueError, match=rf"p-[0-9a-f]{{12}}\.json {problem}.*delete it"):
            cache.get("p", "h", {})


def test_two_stages_starting_together_estimate_b0_once(tmp_path, renderer):
    """The three efforts of a domain start at once: one plays the cold start, the others wait for
    it and read its entries (each stage its own engine and environment, as in its own process)."""
    from posttrain.engines import EmbeddedEngine
    from posttrain.engines.testing import tiny_k3
    from posttrain.envs.environments import EnvironmentConfig, make_environment
    from posttrain.rewards.budget import BudgetConfig, base_budgets

    cfg = BudgetConfig(cold_start={"samples": 2})
    config = EnvironmentConfig(max_turns=1, max_tokens_per_turn=6)
    start = threading.Barrier(2)
    results: list[tuple[dict, dict]] = []

    def stage(name: str) -> None:
        engine = EmbeddedEngine(tiny_k3(0).eval(), pad_token_id=renderer.pad_id)
        with make_environment("general", renderer, config, sandbox_dir=tmp_path / name) as env:
            prompts = env.prompts("train", 6, 0)
            start.wait()
            results.append(
                base_budgets(env, engine, prompts, cfg, seed=0, policy_id="sft", cache_dir=tmp_path / "cache")
            )

    threads = [threading.Thread(target=stage, args=(name,)) for name in ("low", "high")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (budgets_a, metrics_a), (budgets_b, metrics_b) = results
    assert sorted([metrics_a["budget/cold_start_prompts"], metrics_b["budget/cold_start_prompts"]]) == [0, 6]
    assert budgets_a == budgets_b and len(budgets_a) == 6
