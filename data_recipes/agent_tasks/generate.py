"""Generate the shipped SFT trajectories: `python -m data_recipes.agent_tasks.generate`.

Each trajectory depends only on (seed, family, index): its own `random.Random` is seeded from that
string and its tools run in a fresh sandbox, so any row can be regenerated alone and the whole
file is byte-identical on every run. Efforts cycle low/high/max over the index. The route-choice
families ship ROUTE_CHOICE_ROW_SHARE of a family's rows: the share measured (bench/RESULTS.md); a
larger one cost the other agent families more of the SFT model's accuracy on the first branch.
Only the shipped arguments (--seed 0, --per-family 200) write the shipped file; other ones need
--out, so a trial set never replaces the rows the default recipe trains on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from data_recipes.agent_tasks import FAMILIES
from data_recipes.shipped import check_shipped_out
from posttrain.data.sample import EFFORTS, Sample
from posttrain.envs.environments import HarnessConfig
from posttrain.envs.tasks import TASK_FAMILIES
from posttrain.files import atomic_write_text

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "data" / "agent_sft.jsonl"
DEFAULT_PER_FAMILY = 200
ROUTE_CHOICE_ROW_SHARE = {
    "agent/order_cost": 0.6,
    "general/unit_cost": 0.6,
    "coding/crate_cost": 0.6,
    "coding/unit_convert": 0.6,
    "coding/arithmetic": 0.6,
}
# Harness diversity in the demonstrations: each row offers one extra tool set beside its family's
# own, drawn as the RL and MOPD stages draw theirs (stages/rl.yaml, stages/mopd.yaml: the same
# pools, tests/envs/test_shipped_harness.py holds them equal). A declaration the SFT data never
# showed is a prompt the SFT model never saw: without it, one seed's SFT model called coding's
# run_python in 11 of 15 agent episodes offering read_file and in none of 17 offering only the
# family's tools (bench/RESULTS.md, issue #21).
SFT_HARNESS = {
    "agent": HarnessConfig(tool_sets=[[], ["read_file"]]),
    "coding": HarnessConfig(tool_sets=[[], ["shell"]]),
}


def family_rows(family_name: str, per_family: int) -> int:
    """How many rows `family_name` ships when the other families ship `per_family`."""
    return round(per_family * ROUTE_CHOICE_ROW_SHARE.get(family_name, 1.0))


def sft_prompt(family_name: str, index: int, seed: int = 0) -> Sample:
    """The prompt of a family's `index`-th SFT row: its own seeded draw, efforts in turn, and its
    domain's SFT_HARNESS tool set."""
    rng = random.Random(f"sft:{seed}:{family_name}:{index}")
    sample = TASK_FAMILIES.get(family_name)().prompt(rng, EFFORTS[index % len(EFFORTS)])
    if sample.domain in SFT_HARNESS:  # its own draw: the prompt and demonstration stay as they were
        SFT_HARNESS[sample.domain].apply(sample, random.Random(f"sft-harness:{seed}:{family_name}:{index}"))
    return sample


def generate_trajectory(family_name: str, index: int, seed: int = 0) -> dict[str, Any]:
    """One demonstrated, verified trajectory record."""
    sample = sft_prompt(family_name, index, seed)
    messages = TASK_FAMILIES.get(family_name)().demonstrate(sample)
    record = {
        "uid": sample.uid,
        "domain": sample.domain,
        "effort": sample.effort,
        "messages": messages,
        "tools": sample.tools,
        "task": sample.task,
    }
    if sample.images:  # a visual family's drawn images (data URIs), in the order of the media parts
        record["images"] = sample.images
    return record


def generate(seed: int = 0, per_family: int = DEFAULT_PER_FAMILY) -> list[dict[str, Any]]:
    return [
        generate_trajectory(name, index, seed)
        for name in FAMILIES
        for index in range(family_rows(name, per_family))
    ]


def to_jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-family", type=int, default=DEFAULT_PER_FAMILY)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if args.per_family < 1:  # the default --out is the shipped file, which it would have emptied
        parser.error(f"--per-family {args.per_family}: pass at least 1 row a family")
    made_by = {"seed": 0, "per_family": DEFAULT_PER_FAMILY}
    check_shipped_out(parser, args.out, DEFAULT_OUTPUT, {k: vars(args)[k] for k in made_by}, made_by)
    records = generate(args.seed, args.per_family)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, to_jsonl(records))  # a kill while writing leaves the old file whole
    print(f"wrote {len(records)} trajectories to {args.out}")


if __name__ == "__main__":
    main()
