"""Does an SFT model call the tools its prompt declares, whatever else the prompt declares?

The RL and MOPD stages offer each prompt one extra tool set beside its family's own
(`stages/rl.yaml`'s `environments.<domain>.harness.tool_sets`), so a prompt may declare a tool the
demonstrations never called. This scores the shipped SFT rows of a domain teacher-forced, once per
tool set of that harness: the rows' messages with their family's tools plus that set declared. At
every demonstrated tool call it reads the model's probability of the demonstrated tool's name and
the mass on registered tools the prompt does not declare. Prints, per model and tool set, the mean
of both and the share of calls where the demonstrated name is below one half. This is how one SFT
seed's failure was found: offered `read_file`, its model put 0.33 of an agent call's probability on
coding's `run_python` on average (35% of the calls below one half), and its agent specialists stayed
near 0.28 (bench/RESULTS.md).

    PYTHONPATH=.:bench python bench/tool_declarations.py runs/mopd/sft/model --domain agent
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from stage_policy import REPO, load_policy, rl_harness

from posttrain.envs.tasks import TASK_FAMILIES
from posttrain.envs.tools import TOOLS, make_tools

SHIPPED_ROWS = REPO / "data_recipes" / "data" / "agent_sft.jsonl"


def family_rows(domain: str, limit: int) -> list[dict]:
    """The first `limit` shipped rows of each of `domain`'s families, each declaring only its
    family's own tools (a row's harness draw removed, so every tool set is scored on the same rows)."""
    rows: list[dict] = []
    taken: dict[str, int] = {}
    own: dict[str, set[str]] = {}  # per family, the names of its own tools
    for line in SHIPPED_ROWS.read_text().splitlines():
        row = json.loads(line)
        family = row["task"]["family"]
        if row["domain"] != domain or taken.get(family, 0) >= limit:
            continue
        taken[family] = taken.get(family, 0) + 1
        if family not in own:
            own[family] = set(TASK_FAMILIES.get(family)().toolset())
        row["tools"] = [tool for tool in row["tools"] if tool["function"]["name"] in own[family]]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", type=Path, nargs="+", help="stage model/ directories")
    parser.add_argument("--domain", default="agent", choices=("agent", "coding"))
    parser.add_argument("--rows", type=int, default=50, help="rows per task family")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = family_rows(args.domain, args.rows)
    tool_sets = rl_harness(args.domain).harness.tool_sets
    print(f"{len(rows)} shipped {args.domain} rows; tool sets of stages/rl.yaml's harness: {tool_sets}")
    for model_dir in args.model_dirs:
        policy = load_policy(model_dir)
        renderer, vocab = policy.renderer, policy.tokenizer.get_vocab()
        # a tool's name is one token of the K3 tokenizer: "functions.<name>:" (the call's index follows)
        name_ids = {name: vocab[f"functions.{name}:"] for name in TOOLS if f"functions.{name}:" in vocab}
        call_begin = renderer.token_ids["tool_call_begin"]
        print(model_dir)
        for tool_set in tool_sets:
            right, undeclared, below_half = [], [], 0
            extra = [tool.schema for tool in make_tools(tool_set).values()]
            for row in rows:
                tools = row["tools"] + extra
                declared = {tool["function"]["name"] for tool in tools}
                ids, _ = renderer.render(row["messages"], tools, row["effort"])
                with torch.no_grad():
                    probs = torch.softmax(policy.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
                others = [token for name, token in name_ids.items() if name not in declared]
                for position in (i for i, token in enumerate(ids[:-1]) if token == call_begin):
                    p = probs[position]
                    right.append(p[ids[position + 1]].item())
                    undeclared.append(p[others].sum().item())
                    below_half += right[-1] < 0.5
            print(
                f"  + {tool_set or 'no extra tool'}: {len(right)} calls, P(demonstrated tool) "
                f"{sum(right) / len(right):.3f}, below 0.5 in {below_half / len(right):.1%}; "
                f"P(an undeclared tool) {sum(undeclared) / len(undeclared):.4f}"
            )


if __name__ == "__main__":
    main()
