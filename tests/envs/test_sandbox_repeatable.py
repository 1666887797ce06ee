"""A program's output is tool output the model reads, so the same program must print the same thing
in every sandbox and every run: without that, a rerun or a resumed step plays other tokens from the
same weights and trains otherwise (a coding rollout printing a set or an object did, bench/RESULTS.md).
Two sandboxes are two init processes, as two runs are."""

from __future__ import annotations

from pathlib import Path

from posttrain.envs.sandbox import Sandbox

# Per-process string hashing (set order, hash()) and address-space randomisation (object reprs, id())
# are what differed between runs before the sandbox fixed them.
PROGRAM = (
    "s = {'apple', 'pear', 'fig', 'kiwi', 'plum', 'lime'}; print(s); print(hash('abc'));"
    " print(object()); print(id([])); print(f'{id(print):x}')"
)


def _output(root: Path) -> str:
    with Sandbox(snapshot_root=root) as sandbox:
        result = sandbox.run(["python3", "-c", PROGRAM], timeout=10)
        assert result.exit_code == 0, result.stderr
        return result.stdout


def test_a_program_prints_the_same_set_order_hashes_and_addresses_in_every_sandbox(tmp_path: Path):
    first, second = _output(tmp_path / "a"), _output(tmp_path / "b")
    assert first.count("\n") == 5 and "object object at 0x" in first
    assert first == second


def test_a_command_may_still_choose_its_own_hash_seed(sandbox: Sandbox):
    seeded = [
        sandbox.run(["python3", "-c", "print(hash('abc'))"], env={"PYTHONHASHSEED": s}).stdout for s in "12"
    ]
    assert seeded[0] != seeded[1]
