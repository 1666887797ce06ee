"""RL environments, one per domain: where prompts come from, how an episode is played, how it is scored.

An environment draws prompts from the registered task families of its domain (posttrain.envs.tasks;
the shipped ones live in data_recipes/agent_tasks), plays episodes against an `Engine` and scores
them with the family's hidden verifier (or a generative reward model where configured). The
episode loop is the same for every domain and for every caller (RL rollouts, the budget's cold
start, evaluation, MOPD):

    engine generates one assistant turn -> it ends on a tool call, an end of turn or the length cap
    -> the turn is parsed (ChatRenderer.parse_assistant) and its tool calls run for real (in a
    sandbox where the tool needs one) -> the tool messages are rendered and appended to the tokens
    (render_tool_results, loss mask 0) -> the engine continues from exactly those tokens.

Tokens are only ever appended, never re-rendered (the exact-prefix rule), so what the trainer scores
is what the engine sampled. Harness diversity: each prompt gets a system prompt and a set of extra
tools drawn from a configured pool, so a specialist is not tied to one protocol.

Domains differ in what the verifier sees: general scores the final answer (exact, normalised
match); agent scores the final state of the sandbox (the files written), which the policy never
sees; coding runs hidden unit tests on each submitted answer in a separate, fresh sandbox and
allows a limited number of submissions, answering a failed one with "tests failed, k left", never
with the tests.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.data.chat import ChatRenderer
from posttrain.data.sample import Sample
from posttrain.engines.base import Engine, LogprobsMode, PauseWhen, SamplingConfig
from posttrain.envs.env_sandboxes import SandboxPool
from posttrain.envs.sandbox import Sandbox
from posttrain.envs.tasks import TASK_FAMILIES, Episode, TaskFamily, check_listed_once, registered_family
from posttrain.envs.tools import TOOLS, Tool, make_tools
from posttrain.files import remove_tree
from posttrain.registry import Registry
from posttrain.rewards.genrm import GenRM

# Sample.metrics keys an environment maintains (JSON-safe floats, so they survive a checkpoint).
TASK_REWARD = "task_reward"
SUBMISSIONS = "submissions"
TRUNCATED = "truncated"
# A turn that ended with one of these answered; a "tool_call" turn continues the episode.
ANSWERED = ("stop", "length")
# The pause rule of an episode loop: given how many episodes have ended in this call, pause now?
PauseRule = Callable[[int], bool]
SANDBOX_LIMITS: dict[str, Any] = {"memory_mb": 512, "cpu_seconds": 30, "max_processes": 64, "network": False}
# Sandboxes an environment keeps for reuse once its episodes give them back. Starting one costs
# 66 ms (a restore 1 ms) and an idle one about 5 MB; an evaluation or a cold start lends hundreds
# at once (MOPD's sampled one up to 384 in agent and coding each), and with only 32 kept every
# later batch started most of its sandboxes again (bench/RESULTS.md, issue #21).
POOLED_SANDBOXES = 512
# prompts() gives up once this many draws in a row (at least REPEATS_FLOOR) brought no new question,
# per distinct question seen: its families have (nearly) run out. The last of F equally likely
# families' N questions each takes about F x N draws, the distinct count, so ten times that cuts a
# draw that would still succeed about once in e^10; the shipped stage files' longest run of repeats
# is under 100 draws. Without it an impossible count ran its count x 50 draws (rollout.prompts=100000
# in the agent domain: 5 million draws, minutes) before saying so.
REPEATS_PER_QUESTION = 10
REPEATS_FLOOR = 1000
SUBMISSION_FEEDBACK = (
    "The hidden tests failed. {left} submission{s} left: fix the code and reply with the complete function."
)


class HarnessConfig(BaseModel):
    """Harness diversity: the system prompt and extra tools of each prompt, drawn from pools."""

    model_config = ConfigDict(extra="forbid")
    system_prompts: list[str] = Field(
        default_factory=list, description="pool of system prompts; empty: each task family's own rotation"
    )
    tool_sets: list[list[str]] = Field(
        default_factory=lambda: [[]],
        description="pool of extra registered tools offered beside the family's own, one set per prompt",
    )

    @field_validator("tool_sets")
    @classmethod
    def _known_tools(cls, tool_sets: list[list[str]]) -> list[list[str]]:
        if not tool_sets:
            raise ValueError("harness.tool_sets needs at least one set; [[]] offers no extra tool")
        for tool_set in tool_sets:
            for name in tool_set:
                if name not in TOOLS:
                    raise ValueError(
                        f"harness.tool_sets: unknown tool {name!r} (registered: {', '.join(TOOLS)})"
                    )
                try:
                    make_tools([name])
                except TypeError as error:
                    raise ValueError(
                        f"harness.tool_sets: tool {name!r} needs settings of its own ({error}); "
                        "offer it through a task family instead"
                    ) from None
        return tool_sets

    def apply(self, prompt: Sample, rng: random.Random) -> None:
        """Give `prompt` (in place) a system prompt and an extra tool set drawn from the pools. The
        shipped SFT rows are drawn through this too (data_recipes/agent_tasks/generate.py), so the
        SFT model has seen every tool declaration the RL and MOPD prompts make."""
        if self.system_prompts:
            system = {"role": "system", "content": rng.choice(self.system_prompts)}
            if prompt.messages and prompt.messages[0]["role"] == "system":
                prompt.messages[0] = system
            else:
                prompt.messages.insert(0, system)
        offered = {tool["function"]["name"] for tool in prompt.tools}
        extra = [name for name in rng.choice(self.tool_sets) if name not in offered]
        prompt.tools += [tool.schema for tool in make_tools(extra).values()]


class EnvironmentConfig(BaseModel):
    """How one domain's episodes are played and scored."""

    model_config = ConfigDict(extra="forbid")
    families: list[str] = Field(
        default_factory=list,
        description="task families to draw prompts from, in turn, each listed once; empty: every registered "
        "one of the domain",
    )
    max_turns: int = Field(4, gt=0, description="assistant turns per episode")
    max_tokens_per_turn: int = Field(96, gt=0, description="generated tokens per assistant turn")
    max_submissions: int = Field(
        1, gt=0, description="coding: answers run against the hidden tests per episode"
    )
    reward: Literal["verifier", "genrm"] = Field(
        "verifier", description="verifier: the task family's hidden verifier; genrm: the stage's judge model"
    )
    verify_workers: int = Field(
        4, gt=0, description="coding: hidden-test runs in parallel (each in its own sandbox)"
    )
    harness: HarnessConfig = Field(default_factory=HarnessConfig)


@dataclass(eq=False)
class _Play:
    """One episode in flight."""

    sample: Sample
    episode: Episode
    sandbox: Sandbox | None = None
    done: bool = False


class PromptCountError(ValueError):
    """Fewer distinct prompts exist than `key` (a stage-file key, or a phrase naming two) asks for:
    `count` were asked of `split`, `drawn` could be drawn."""

    def __init__(self, message: str, key: str, split: str, count: int, drawn: int) -> None:
        super().__init__(message)
        self.key, self.split, self.count, self.drawn = key, split, count, drawn


class PromptSource:
    """One domain's task families under its harness, drawing prompts. An environment draws through
    one; built alone (`Environment.prompt_source`: no renderer, no sandboxes) it makes a stage's
    draws when its stage file is read, so a prompt count the families cannot meet is refused by
    `plan`, not at the stage's start after its needs have run."""

    def __init__(self, domain: str, family_names: Sequence[str], harness: HarnessConfig) -> None:
        self.domain = domain
        self.family_names = list(family_names)
        self.harness = harness
        self.families: dict[str, TaskFamily] = {name: TASK_FAMILIES.get(name)() for name in family_names}

    def prompts(self, *args: Any, **kwargs: Any) -> list[Sample]:
        """All of `draws`, its arguments."""
        return list(self.draws(*args, **kwargs))

    def draws(
        self,
        split: str,
        count: int,
        seed: int,
        exclude: Sequence[Sample] = (),
        families: Sequence[str] | None = None,
        key: str = "the prompt count",
    ) -> Iterator[Sample]:
        """`count` distinct prompts, one at a time, families in turn (`families`, a subset of those
        offered, or all of them), harness applied; a pure function of its arguments. Questions of
        `exclude` (e.g. the held-out set when drawing training prompts) never appear. `key`: the
        stage-file key that set `count`, named in the PromptCountError raised when fewer distinct
        prompts exist (known once a long run of draws, REPEATS_PER_QUESTION per distinct question,
        brought no new one): domains drawn in turn (`draw_in_turn`) stop at the first that runs out."""
        rng = random.Random(f"rl-prompts:{self.domain}:{split}:{seed}")
        seen = {_question(p) for p in exclude}
        drawn = 0
        names = list(families) if families else self.family_names
        unknown = [name for name in names if name not in self.families]
        if unknown:
            raise ValueError(
                f"{self.domain}: {unknown} are not among the offered families {self.family_names}"
            )
        repeats = 0  # draws in a row that brought no new question
        for attempt in range(count * 50):
            if drawn == count or repeats >= max(REPEATS_FLOOR, REPEATS_PER_QUESTION * len(seen)):
                break
            prompt = self.families[names[attempt % len(names)]].prompt(rng, "high")
            if _question(prompt) in seen:
                repeats += 1
                continue
            repeats = 0
            seen.add(_question(prompt))
            self.harness.apply(prompt, rng)
            drawn += 1
            yield prompt
        if drawn < count:
            excluded = f", besides the {len(exclude)} excluded" if exclude else ""
            raise PromptCountError(
                f"{self.domain}: only {drawn} distinct {split} prompts could be drawn from {names} "
                f"(the last {repeats} draws brought no new one{excluded}), {count} were asked for; "
                f"lower {key} to at most {drawn}",
                key,
                split,
                count,
                drawn,
            )


def draw_in_turn(draws: Mapping[str, Iterable[Sample]]) -> dict[str, list[Sample]]:
    """Each domain's draws (`PromptSource.draws`), one prompt from each in turn: a domain whose
    families cannot meet its count fails after its own draws, not after every domain before it has
    drawn its whole count (at plan, a mistyped count of 10^5 prompts a step took minutes)."""
    out: dict[str, list[Sample]] = {domain: [] for domain in draws}
    live = {domain: iter(d) for domain, d in draws.items()}
    while live:
        for domain, it in list(live.items()):
            prompt = next(it, None)
            if prompt is None:
                del live[domain]
            else:
                out[domain].append(prompt)
    return out


class Environment:
    """The episode loop and prompt source of one domain (subclasses say how episodes are scored).

    renderer: the policy's ChatRenderer. sandbox_dir: where pooled sandboxes write snapshots of
    paused episodes (default: a temporary directory). judge: required when config.reward is
    "genrm".
    """

    domain: ClassVar[str]
    submits: ClassVar[bool] = False

    def __init__(
        self,
        renderer: ChatRenderer,
        config: EnvironmentConfig | None = None,
        *,
        sandbox_dir: Path | None = None,
        judge: GenRM | None = None,
    ) -> None:
        self.renderer = renderer
        self.config = config or EnvironmentConfig()
        if self.config.reward == "genrm" and judge is None:
            raise ValueError(
                f"the {self.domain} environment has reward: genrm but no judge; add a `genrm:` block "
                "(judge model and rubric) to the stage file, or set reward: verifier"
            )
        self.check_config(self.config)
        self.judge = judge
        self.source = PromptSource(self.domain, self.offered_families(self.config), self.config.harness)
        self.sandboxes = SandboxPool(
            sandbox_dir or Path(tempfile.mkdtemp(prefix=f"rl-{self.domain}-sandboxes-")),
            max_idle=POOLED_SANDBOXES,
            **SANDBOX_LIMITS,
        )

    @classmethod
    def check_config(cls, config: EnvironmentConfig) -> None:
        """Raise ValueError naming the key when `config` asks for what this environment cannot
        play: the rl and mopd kinds' schemas call it when a stage file is read (so `plan` reports
        it, not the stage's start after its needs have run), and __init__ again."""
        if config.max_submissions > 1 and not cls.submits:
            raise ValueError(
                f"{cls.domain}: max_submissions is {config.max_submissions}, but only the coding environment "
                f"runs submissions against hidden tests; the {cls.domain} environment scores its final state "
                "once"
            )
        try:
            check_listed_once(config.families)
        except ValueError as error:
            raise ValueError(f"{cls.domain}: families: {error}") from None
        for name in config.families:
            try:
                family = registered_family(name, cls.domain)
            except ValueError as error:
                raise ValueError(f"{cls.domain}: families: {error}") from None
            if family.domain != cls.domain:
                raise ValueError(
                    f"{cls.domain}: task family {name!r} belongs to domain {family.domain!r}, not "
                    f"{cls.domain!r}; list it under the {family.domain} environment"
                )

    @property
    def family_names(self) -> list[str]:
        return self.source.family_names

    @classmethod
    def offered_families(cls, config: EnvironmentConfig) -> list[str]:
        """The families `config` lists, or every registered one of the domain that is not opt-in."""
        if config.families:
            return list(config.families)
        names = [
            name
            for name, family in TASK_FAMILIES.items()
            if family.domain == cls.domain and not family.opt_in
        ]
        if not names:
            raise ValueError(
                f"no task family of domain {cls.domain!r} is registered; list the families under "
                f"environments.{cls.domain}.families or install a plug-in that registers some"
            )
        return names

    @classmethod
    def prompt_source(cls, config: EnvironmentConfig) -> PromptSource | None:
        """The prompts this environment would draw under `config`, built without playing anything;
        None for a subclass that draws its own (it overrides `prompts`): its draws are its own."""
        if cls._draws_its_own():
            return None
        return PromptSource(cls.domain, cls.offered_families(config), config.harness)

    # Prompts ---------------------------------------------------------------------------------

    def prompts(self, *args: Any, **kwargs: Any) -> list[Sample]:
        """Distinct prompts of this environment's families: `PromptSource.prompts`, its arguments."""
        return self.source.prompts(*args, **kwargs)

    def draws(self, *args: Any, **kwargs: Any) -> Iterator[Sample]:
        """`prompts`, one at a time (`PromptSource.draws`); a subclass's own `prompts`, whole."""
        if self._draws_its_own():
            return iter(self.prompts(*args, **kwargs))
        return self.source.draws(*args, **kwargs)

    @classmethod
    def _draws_its_own(cls) -> bool:
        """Whether a subclass (a plug-in's environment) overrides `prompts` with draws of its own."""
        return cls.prompts is not Environment.prompts

    def start(self, prompt: Sample, *, uid: str, group: str, effort: str) -> Sample:
        """A fresh trajectory of `prompt`: its messages rendered with the effort marker, ending in
        the assistant header. task["prompt_uid"] names the prompt (budget b0 is per prompt)."""
        sample = Sample(
            uid=uid,
            domain=self.domain,
            effort=effort,
            group=group,
            messages=copy.deepcopy(prompt.messages),
            tools=copy.deepcopy(prompt.tools),
            task={**copy.deepcopy(prompt.task), "prompt_uid": prompt.uid},
            images=copy.deepcopy(prompt.images),
        )
        ids = self.renderer.render_prompt(
            sample.messages, sample.tools, effort, media=self.renderer.media_blocks(sample.images)
        )
        sample.append(ids, generated=False)
        sample.prompt_length = len(ids)
        return sample

    def turn_sampling(self, temperature: float, seed: int, logprobs: LogprobsMode = "raw") -> SamplingConfig:
        """How one turn of this domain's episodes is decoded: up to max_tokens_per_turn, ending at
        the end of the turn or of a tool call (play acts on it, then the next turn starts)."""
        return SamplingConfig(
            max_tokens=self.config.max_tokens_per_turn,
            temperature=temperature,
            seed=seed,
            stop_token_ids=(self.renderer.end_of_turn_id,),
            tool_call_token_ids=(self.renderer.tool_calls_end_id,),
            logprobs=logprobs,
        )

    # The episode loop ------------------------------------------------------------------------

    def play(
        self,
        engine: Engine,
        samples: list[Sample],
        sampling: SamplingConfig,
        should_pause: PauseRule | None = None,
    ) -> None:
        """Play each sample's episode until it ends or generation pauses: `play_episodes` over
        this one environment."""
        play_episodes(
            {self.domain: self}, engine, samples, {self.domain: sampling}, should_pause=should_pause
        )

    def _open(self, sample: Sample) -> _Play:
        if sample.done:
            raise ValueError(f"sample {sample.uid}: its episode already ended; play a fresh or paused one")
        if not sample.tokens:
            raise ValueError(f"sample {sample.uid} has no tokens; make it with Environment.start")
        family = self.source.families.get(sample.task.get("family", ""))
        if family is None:
            raise ValueError(
                f"sample {sample.uid}: task family {sample.task.get('family')!r} is not one of the "
                f"{self.domain} environment's ({', '.join(self.source.families)})"
            )
        episode = Episode(family, sample, None)
        extra = [t["function"]["name"] for t in sample.tools if t["function"]["name"] not in episode.toolset]
        episode.toolset = {**episode.toolset, **make_tools(extra)}
        play = _Play(sample, episode)
        if sample.sandbox_snapshot:
            play.sandbox = episode.sandbox = self.sandboxes.acquire(sample.sandbox_snapshot)
            # The live copy is consumed; a checkpoint taken while the episode was paused has its own.
            remove_tree(Path(sample.sandbox_snapshot))
            sample.sandbox_snapshot = None
        return play

    def _act(self, plays: list[_Play]) -> list[_Play]:
        """Act on each play's just-generated turn; returns the plays that continue (their tool
        results or feedback appended, ending in the next assistant header)."""
        going, answers = [], []
        for play in plays:
            sample = play.sample
            turn = sample.tokens[len(sample.tokens) - sample.trailing_generated :]
            message = self.renderer.parse_assistant(turn)
            calls = message.get("tool_calls") or []
            if any(self._needs_sandbox(play, call) for call in calls) and play.sandbox is None:
                play.sandbox = play.episode.sandbox = self.sandboxes.acquire()
            results = play.episode.step(message)
            sample.messages = play.episode.messages
            turns = sum(m["role"] == "assistant" for m in sample.messages)
            if sample.finish_reason == "length":
                sample.metrics[TRUNCATED] = 1.0
            if results and sample.finish_reason == "tool_call" and turns < self.config.max_turns:
                sample.append(self.renderer.render_tool_results(results), generated=False)
                going.append(play)
            elif not calls and self.submits and self.config.reward == "verifier":
                answers.append(play)
            else:
                play.done = True
        for play in self._submit(answers):
            going.append(play)
        for play in plays:
            if play.done:
                play.sample.done = True
        return going

    def _needs_sandbox(self, play: _Play, call: Mapping[str, Any]) -> bool:
        tool: Tool | None = play.episode.toolset.get(call.get("function", {}).get("name", ""))
        return tool is not None and tool.needs_sandbox

    def _submit(self, answers: list[_Play]) -> list[_Play]:
        """Coding: run the hidden tests on each answer; failed ones with submissions left get
        feedback and continue. Returns those."""
        if not answers:
            return []
        with ThreadPoolExecutor(max_workers=self.config.verify_workers) as pool:
            verdicts = list(pool.map(lambda p: p.episode.reward(), answers))
        going = []
        for play, verdict in zip(answers, verdicts, strict=True):
            sample = play.sample
            sample.metrics[SUBMISSIONS] = sample.metrics.get(SUBMISSIONS, 0.0) + 1
            sample.metrics[TASK_REWARD] = float(verdict)
            left = self.config.max_submissions - int(sample.metrics[SUBMISSIONS])
            turns = sum(m["role"] == "assistant" for m in sample.messages)
            if (
                verdict < 1.0
                and left > 0
                and turns < self.config.max_turns
                and sample.finish_reason == "stop"
            ):
                feedback = {
                    "role": "user",
                    "content": SUBMISSION_FEEDBACK.format(left=left, s="" if left == 1 else "s"),
                }
                play.episode.messages.append(feedback)
                play.episode.done = False
                sample.append(self.renderer.render_tool_results([feedback]), generated=False)
                going.append(play)
            else:
                play.done = True
        return going

    def _park(self, play: _Play) -> None:
        """A paused episode keeps its sandbox's files as a snapshot; the sandbox goes back."""
        if play.sandbox is not None:
            play.sample.sandbox_snapshot = play.sandbox.snapshot()
            self.sandboxes.release(play.sandbox)
            play.sandbox = None

    # Scoring ---------------------------------------------------------------------------------

    def _finish(self, plays: list[_Play]) -> None:
        """Score the episodes that ended (their final state) and give their sandboxes back."""
        self._score(plays)
        for play in plays:
            if play.sandbox is not None:
                self.sandboxes.release(play.sandbox)
                play.sandbox = None

    def _score(self, plays: list[_Play]) -> None:
        if not plays:
            return
        if self.config.reward == "genrm":
            assert self.judge is not None
            judgements = self.judge.score_samples([p.sample for p in plays])
            rewards = [j.reward for j in judgements]
        else:
            rewards = [self._verify(p) for p in plays]
        for play, reward in zip(plays, rewards, strict=True):
            play.sample.reward = reward
            if reward is not None:
                play.sample.metrics[TASK_REWARD] = float(reward)

    def _verify(self, play: _Play) -> float:
        return play.episode.reward()

    def close(self) -> None:
        self.sandboxes.close()

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment")


@ENVIRONMENTS.register("general")
class GeneralEnvironment(Environment):
    """Reasoning and knowledge questions, scored by exact (normalised) match of the final answer."""

    domain = "general"


@ENVIRONMENTS.register("agent")
class AgentEnvironment(Environment):
    """Multi-turn tool use (search the shipped documents, compute, write a file) in a persistent
    sandbox, scored on the sandbox's final files by the family's hidden verifier."""

    domain = "agent"


@ENVIRONMENTS.register("coding")
class CodingEnvironment(Environment):
    """Write or fix code; each answer is a submission run against hidden unit tests in a fresh
    sandbox of its own (the policy's sandbox never holds the tests), at most max_submissions per
    episode. The episode's reward is its last submission's."""

    domain = "coding"
    submits = True

    def _verify(self, play: _Play) -> float:
        # Submissions were verified as they were made; an episode that never answered scores 0.
        return play.sample.metrics.get(TASK_REWARD, 0.0)


def play_episodes(
    envs: Mapping[str, Environment],
    engine: Engine,
    samples: list[Sample],
    sampling: Mapping[str, SamplingConfig],
    *,
    should_pause: PauseRule | None = None,
    on_finished: Callable[[list[Sample]], None] | None = None,
) -> None:
    """The episode loop, for every caller (RL rollouts with partial-rollout pausing, the budget's
    cold start, evaluations, MOPD, SFT's tool-task eval): each turn the engine decodes every
    episode still going (one call per distinct sampling config, so several domains decode in one
    batch), each sample's environment (`envs[sample.domain]`) acts on the turn (tools run, results
    or feedback appended), and the episodes that ended are scored and handed to `on_finished`.

    samples: fresh trajectories (Environment.start) or paused ones (finish_reason "paused": they
      continue from their tokens, their sandbox restored from `sample.sandbox_snapshot`).
    sampling: domain -> how a turn of that domain's episodes is decoded (Environment.turn_sampling).
    should_pause(ended) -> bool: asked between decoding steps and between turns with the number of
      episodes ended so far in this call (turns that just answered count as ended). Once it says
      yes, every episode still going is paused: finish_reason "paused", its sandbox written to a
      snapshot (`sample.sandbox_snapshot`) and given back to the pool.
    Ended episodes get sample.done, sample.reward (the task reward; None when a judge could not
    score it) and metrics task_reward, submissions, truncated.
    """
    for sample in samples:
        if sample.domain not in envs:
            raise ValueError(
                f"sample {sample.uid}: no environment for domain {sample.domain!r} ({', '.join(envs)})"
            )
    plays = [(envs[s.domain], envs[s.domain]._open(s)) for s in samples]
    try:
        going, ended = list(plays), 0
        while going and not (should_pause is not None and should_pause(ended)):
            pause_when = None if should_pause is None else _pause_rule(should_pause, ended)
            for config in dict.fromkeys(sampling[p.sample.domain] for _, p in going):
                batch = [p.sample for _, p in going if sampling[p.sample.domain] == config]
                engine.generate(batch, config, pause_when=pause_when)
            # Rows the engine paused leave the loop; the others' environments act on their turn.
            turned = [(env, p) for env, p in going if p.sample.finish_reason != "paused"]
            going = [(env, p) for env in envs.values() for p in env._act([p for e, p in turned if e is env])]
            finished = [(env, p) for env, p in turned if p.done]
            ended += len(finished)
            for env in envs.values():
                env._finish([p for e, p in finished if e is env])
            if finished and on_finished is not None:
                on_finished([p.sample for _, p in finished])
        for _, play in going:
            play.sample.finish_reason = "paused"
        for env, play in plays:
            if play.sample.finish_reason == "paused":
                env._park(play)
    finally:
        for env, play in plays:
            if play.sandbox is not None:
                env.sandboxes.release(play.sandbox)
                play.sandbox = None


def make_environment(
    domain: str,
    renderer: ChatRenderer,
    config: EnvironmentConfig | None = None,
    *,
    sandbox_dir: Path | None = None,
    judge: GenRM | None = None,
) -> Environment:
    """The registered environment of `domain`."""
    return ENVIRONMENTS.get(domain)(renderer, config, sandbox_dir=sandbox_dir, judge=judge)


def _pause_rule(should_pause: PauseRule, ended: int) -> PauseWhen:
    """The engine's pause_when for one generate call: rows that answered in it count as ended."""
    return lambda rows: should_pause(ended + sum(row.finish_reason in ANSWERED for row in rows))


def _question(prompt: Sample) -> str:
    """What makes two prompts the same task: everything but the system prompt and tools."""
    question = [m for m in prompt.messages if m["role"] != "system"]
    if prompt.images:  # one question text over many drawn images: the images tell them apart
        question.append({"images": prompt.images})
    return json.dumps(question, sort_keys=True)
