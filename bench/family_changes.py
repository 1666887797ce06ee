"""An RL stage's held-out accuracy change per task family, with paired standard errors.

eval.json holds the greedy episodes before (the init model) and after RL, the same prompts in the
same order; each episode's uid names its prompt and so its family (`eval/<family>-<hex>/0`). The
stage's report gives the domain's change; a new family's effect, or another family's loss, only
shows per family.

    PYTHONPATH=. python bench/family_changes.py RUN/rl-agent-max/eval.json RUN/rl-agent-low/eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from posttrain.envs.env_eval import eval_family
from posttrain.stats import paired_standard_error


def changes(eval_json: Path) -> list[str]:
    report = json.loads(eval_json.read_text())
    before, after = report["episodes"]["before"], report["episodes"]["after"]
    lines = [f"{eval_json}: {report['stage']}"]
    families = sorted({eval_family(uid) for uid in before["uid"]})
    for family in [*families, "all"]:
        rows = [i for i, uid in enumerate(before["uid"]) if family in ("all", eval_family(uid))]
        b = [before["reward"][i] for i in rows]
        a = [after["reward"][i] for i in rows]
        lines.append(
            f"  {family:24s} n={len(rows):3d}  {sum(b) / len(b):.3f} -> {sum(a) / len(a):.3f}  "
            f"change {(sum(a) - sum(b)) / len(b):+.3f} ± {paired_standard_error(b, a):.3f}  "
            f"solved {sum(b):.0f} -> {sum(a):.0f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eval_jsons", type=Path, nargs="+")
    for path in parser.parse_args().eval_jsons:
        print("\n".join(changes(path)))


if __name__ == "__main__":
    main()
