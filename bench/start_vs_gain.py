"""Does an RL stage's gain depend on where its SFT model started? One stage over many seeds.

`bench/outcomes.py` reports a claim's seed mean; when a claim misses in some seeds, the question is
whether RL failed to learn there or had nothing left to learn. Each seed's eval.json holds the
held-out episodes before (the SFT model) and after RL on the same prompts, so for every given
eval.json this prints the solved counts before -> after, overall and per task family, then over
the seeds: the mean and spread of before, after and gain, the spread one binomial draw of the
mean accuracy would have (so an `after` spread no larger than that is a plateau measured with
noise), and how `after` follows `before` (a slope of 1: RL adds the same to every start; 0: every
seed ends at one plateau, so a high start leaves nothing to gain).

    PYTHONPATH=. python bench/start_vs_gain.py runs/outcomes/seed-*/rl-general-max/eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from posttrain.envs.env_eval import family_sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eval_jsons", type=Path, nargs="+", help="one stage's eval.json from several seeds")
    args = parser.parse_args()
    before_counts, after_counts, sizes = [], [], set()
    for path in args.eval_jsons:
        report = json.loads(path.read_text())
        before, after = report["episodes"]["before"], report["episodes"]["after"]
        if before["uid"] != after["uid"]:
            raise SystemExit(f"{path}: before and after episodes are not the same prompts in the same order")
        b, a = sum(before["reward"]), sum(after["reward"])
        before_counts.append(b)
        after_counts.append(a)
        sizes.add(len(before["uid"]))
        by_b, by_a = family_sums(before), family_sums(after)
        families = "  ".join(
            f"{f.split('/')[-1]} {by_b[f]:.0f}->{by_a[f]:.0f}" for f in sorted(by_b) if f != "all"
        )
        print(f"{path}: {b:.0f} -> {a:.0f} ({a - b:+.0f})   {families}")
    if len(before_counts) < 3:
        return
    if len(sizes) != 1:
        raise SystemExit(f"the eval.jsons hold different episode counts ({sorted(sizes)}): not one stage")
    n = sizes.pop()
    gains = [a - b for b, a in zip(before_counts, after_counts, strict=True)]
    for name, values in (("before", before_counts), ("after", after_counts), ("gain", gains)):
        print(
            f"{name:6s} mean {statistics.mean(values):5.1f}  sd {statistics.stdev(values):4.1f}  "
            f"range {min(values):.0f}..{max(values):.0f}  (of {n})"
        )
    p = statistics.mean(after_counts) / n
    print(f"one binomial draw of {n} at the mean after accuracy {p:.3f}: sd {math.sqrt(n * p * (1 - p)):.1f}")
    # gain = after - before carries before's own eval noise with a minus sign, so a gain-before
    # correlation is negative even with no dependence; how after follows before is the reading.
    slope = statistics.linear_regression(before_counts, after_counts).slope
    print(
        f"over {len(gains)} seeds: after = {slope:.2f} x before + c (least squares); "
        f"correlation of after with before {statistics.correlation(before_counts, after_counts):+.2f}"
    )


if __name__ == "__main__":
    main()
