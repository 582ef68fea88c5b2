"""The data role's configuration (the ``data`` section of a run's config)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from laminar.runtime.config import ServiceConfig, Strict

from .rewards import RewardFunction, RewardKind, RewardSandbox


class PolicySpec(Strict):
    kind: str = Field(description="A built-in name or module:Class / file.py:Class.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the policy's constructor."
    )


class SamplingConfig(Strict):
    max_tokens: Annotated[int, Field(ge=1)] = Field(256, description="Most response tokens.")
    temperature: Annotated[float, Field(ge=0)] = Field(
        1.0, description="Sampling temperature (keep trainer.temperature equal)."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(1.0, description="Nucleus sampling mass.")
    top_k: Annotated[int, Field(ge=0)] = Field(0, description="Top-k sampling; 0 = off.")
    seed: int | None = Field(
        None,
        description="Set: each trajectory samples with its own seed derived from this and its id "
        "(reproducible runs). null: engine randomness.",
    )
    ignore_eos: bool = Field(
        False,
        description="Generate max_tokens every time, past EOS (fixed-length benchmarks, tests).",
    )


class StalenessConfig(Strict):
    bound: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Max trainer_version - trajectory version a sample may hand out; null = off.",
    )
    action: Literal["drop", "hold"] = Field(
        "drop",
        description="drop: evict staler trajectories for good (counted); hold: skip them but keep "
        "them buffered (a later, larger bound can still use them).",
    )


class FocusConfig(Strict):
    key: str = Field(
        description="The record field whose values class the prompts (a difficulty, a chain "
        "length, a source): the admit rate is learned per value (roles/data/focus.py)."
    )
    window: Annotated[int, Field(ge=1)] = Field(
        16, description="Complete groups per class that its informative rate is taken over."
    )
    floor: Annotated[float, Field(gt=0, le=1)] = Field(
        0.1,
        description="The least admit probability of any class: every class stays sampled, so "
        "one that becomes informative again is noticed.",
    )


class EnvConfig(Strict):
    spec: str = Field(
        description="The task's environment: module:Class or file.py:Class, a subclass of "
        "laminar.tools.env.Environment (multi-turn episodes; docs/agents.md)."
    )
    max_turns: Annotated[int, Field(ge=1)] = Field(
        8, description="Most model turns (actions) per episode; the last one ends it."
    )
    step_timeout_s: Annotated[float, Field(gt=0)] = Field(
        30.0, description="A step running longer ends its episode (no reward, the reason kept)."
    )
    concurrency: Annotated[int, Field(ge=1)] = Field(
        16, description="Environment steps run at once; more wait (the wait is measured)."
    )
    observation_role: Literal["user", "tool"] | None = Field(
        "user",
        description="With a chat template in use: the role of the message an observation "
        "becomes, rendered by the template after the model's turn and followed by the "
        "generation prompt. null: the observation's text is appended as it is (always so "
        "without a template).",
    )


class DataConfig(ServiceConfig):
    prompts: str = Field(
        description="Prompt dataset (relative to the cwd): a .jsonl, .json or .parquet file, or a "
        "directory written by datasets' save_to_disk; verl's parquet layout reads as it is "
        "(docs/data.md)."
    )
    split: str | None = Field(
        None,
        description="A datasets directory holding several splits (a DatasetDict): the split to "
        "read. null: its only split, else `train`.",
    )
    tokenizer: str = Field(description="Model directory (or tokenizer.json) to tokenize prompts.")
    reward: str | Annotated[list[RewardFunction], Field(min_length=1)] | None = Field(
        None,
        description="Reward function: module:function or file.py:function, Laminar's "
        "reward(record, response), verl's compute_score(...) or TRL's reward_func(completions, "
        "**kwargs) (see reward_kind); or a list of {function, weight, kind, name}, whose weighted "
        "sum is the reward (docs/rewards.md). Single-turn tasks; a task with `env` is rewarded by "
        "its environment's steps.",
    )
    env: EnvConfig | None = Field(
        None, description="Multi-turn episodes with an environment instead of a reward function."
    )
    max_prompt_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Leave out prompts longer than this many tokens, chat template applied (a "
        "curriculum, or a bound on the prompt part of the context: verl's max_prompt_length "
        "with filter_overlong_prompts); null: keep all. Those left out are counted "
        "(`prompts_left_out` in the stats).",
    )
    max_model_len: Annotated[int, Field(ge=2)] | None = Field(
        None,
        description="The rollouts' context length; unset, it is taken from the same file's "
        "rollout.engine.max_model_len (laminar.runtime.config.DERIVED). Set: a prompt "
        "that leaves no room for a response (tokens >= this) is left out or refused at load "
        "(overlong_prompts); a prompt that fits but leaves less than sampling.max_tokens gets a "
        "response cut at the limit (finish reason length, counted in the log). null in both: "
        "not checked at load; a rollout's engine refuses such a prompt and its trajectories are "
        "recorded as failed.",
    )
    overlong_prompts: Literal["skip", "refuse"] = Field(
        "skip",
        description="Prompts that leave no room for a response (tokens >= max_model_len). skip: "
        "leave them out, counted (`prompts_left_out` in the stats and the status) and logged "
        "once with the first ids; refuse: the data role does not start, naming the first.",
    )
    id_key: str | None = Field(
        None,
        description="Record field holding the prompt's unique id (every record must have it); a "
        "dotted path reaches into nested fields (verl's `extra_info.index`). null: the field "
        "`id`, or, when no record has one (verl's layout), each prompt's row number (0, 1, ...).",
    )
    prompt_key: str = Field(
        "prompt",
        description="Record field holding the prompt (a dotted path may name a nested field): "
        "a string, or a list of chat messages ({role, content}) rendered with the chat template.",
    )
    chat_template: str = Field(
        "auto",
        description="auto: the model's chat template (tokenizer_config.json's chat_template, or "
        "chat_template.jinja beside it), if it has one; a path (relative to the cwd): that Jinja "
        "template file; none: no template (a prompt of messages is then an error). A template "
        "renders each prompt of messages with the generation prompt; the text is encoded "
        "without adding special tokens again.",
    )
    string_prompts: Literal["text", "user"] = Field(
        "text",
        description="A prompt that is a plain string. text: tokenized as it is, without the "
        "template (TRL's standard records; the tokenizer adds its special tokens, as for any "
        "text). user: one user message rendered with the chat template (as verl does with "
        "every prompt; needs a template).",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put first in every templated prompt that has none of its "
        "own (needs a chat template).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (e.g. enable_thinking: false), as "
        "verl's apply_chat_template_kwargs.",
    )
    samples_per_prompt: Annotated[int, Field(ge=1)] = Field(
        4, description="Trajectories per prompt (a group, for group-relative advantages)."
    )
    redundant_samples: Annotated[int, Field(ge=0)] = Field(
        0,
        description="ROLL Flash's redundant rollouts: start this many more samples per prompt and "
        "keep the first samples_per_prompt to finish; the rest are cancelled (queued ones "
        "withdrawn, running ones dropped at their rollout's next report, late completions "
        "ignored). Cuts the wait for a group's slowest member (a long generation or a slow "
        "environment) at the price of the generation spent on the cancelled ones; up to this "
        "many failed samples (refused, quarantined) leave the group whole. Not with round "
        "schedules.",
    )
    epochs: Annotated[int, Field(ge=1)] | None = Field(1, description="null = cycle forever.")
    seed: int = Field(0, description="Seeds the per-epoch prompt order.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    store: str = Field(
        "runs/latest/data.sqlite",
        description="SQLite file of the prompt, partial-response and experience pools (durable).",
    )
    store_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL",
        description="SQLite synchronous setting of the store. NORMAL: an acknowledged report, "
        "take or sample survives the data role being killed (kill -9, a crash), but an OS crash "
        "or power loss can drop the last ones acknowledged. FULL: each is fsynced before it is "
        "acknowledged, so it also survives an OS crash or power loss (one fsync per call).",
    )
    quarantine_after: Annotated[int, Field(ge=1)] = Field(
        2,
        description="A trajectory whose rollouts died this many times in a row while holding it "
        "(no token acknowledged in between) is recorded as failed (quarantined) instead of "
        "being handed to the next rollout: a poison prompt cannot take down every rollout.",
    )
    queue_ahead: Annotated[int, Field(ge=1)] = Field(
        256, description="Samples kept queued ahead of demand (whole prompt groups)."
    )
    max_ahead: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Backpressure: at most this many trajectories in generation or finished but "
        "not yet trained on; rollouts get no new prompts beyond it. When generation outpaces "
        "training, an unbounded backlog makes staleness grow without limit (FIFO consumption); "
        "about 2 global batches keeps it at 1-3 versions. Unset: no limit.",
    )
    async_ratio: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="ROLL Flash's asynchronous ratio alpha: a rollout is given new prompts only "
        "while the trainer is at most this many versions ahead of its weights (it may still "
        "resume trajectories it started); a staler one gets none until it loads newer weights. "
        "0 = on-policy starts. Unset: no bound (Laminar's default). Under the laminar schedule, "
        "where a rollout already takes no prompts once its relay holds a newer version, it binds "
        "only while versions are on their way to the relays (measured: no effect on the "
        "simulate example's throughput or staleness).",
    )
    reward_workers: Annotated[int, Field(ge=1)] = Field(
        1, description="Worker processes running the reward function."
    )
    reward_timeout_s: Annotated[float, Field(gt=0)] = Field(
        10.0,
        description="A reward call running longer is killed (the trajectory gets no reward; a "
        "batched call's whole batch gets none).",
    )
    reward_kind: RewardKind = Field(
        "auto",
        description="The reward function's convention: laminar (record, response), verl "
        "(data_source, solution_str, ground_truth, extra_info, by keyword), trl (batched: "
        "prompts, completions, completion_ids, the record's fields as lists, trainer_state). "
        "auto: from its parameter names; a signature that fits none, or several, is an error at "
        "start naming the function.",
    )
    reward_batch: Annotated[int, Field(ge=1, le=64)] = Field(
        16,
        description="The most trajectories per call of a batched reward (trl, or any async "
        "def): a free worker takes the trajectories waiting to be scored, up to this many, "
        "without waiting for more. Other rewards are called once per trajectory.",
    )
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for every reward call (verl's "
        "custom_reward_function.reward_kwargs); a function without **kwargs gets those it "
        "declares.",
    )
    reward_sandbox: RewardSandbox = Field(
        default_factory=RewardSandbox,
        description="What a reward worker may use: memory, CPU seconds, processes, environment "
        "(roles/data/rewards.py).",
    )
    drop_constant_groups: bool = Field(
        False,
        description="Dynamic sampling (DAPO): evict complete groups whose rewards are all equal "
        "(advantage 0 for every member) instead of training on them; counted in `filtered`. "
        "Applies to whole-group samples (the trainer's).",
    )
    focus: FocusConfig | None = Field(
        None,
        description="Queue prompts by how informative their class's recent groups were: a drawn "
        "prompt is skipped (not queued in this epoch) with the probability that a group of its "
        "class (the record field `key`) comes out constant, all right or all wrong; at least "
        "`floor` are admitted. Spends generation where RL still learns. Under the laminar "
        "schedule (round schedules queue every drawn prompt). null: every prompt is queued.",
    )
    sampler: PolicySpec = Field(default_factory=lambda: PolicySpec(kind="fifo"))
    eviction: PolicySpec = Field(default_factory=lambda: PolicySpec(kind="none"))
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)

    @model_validator(mode="after")
    def _chat_settings(self) -> DataConfig:
        if self.chat_template == "none" and (
            self.system_prompt is not None or self.string_prompts == "user"
        ):
            raise ValueError(
                "data.system_prompt and data.string_prompts: user need a chat template, and "
                "data.chat_template is none"
            )
        return self

    @model_validator(mode="after")
    def _one_scorer(self) -> DataConfig:
        if (self.reward is None) == (self.env is None):
            raise ValueError(
                "set exactly one of data.reward (single-turn: a reward function) and data.env "
                "(multi-turn: an environment)"
            )
        return self
