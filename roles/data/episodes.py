"""Multi-turn episodes: the data role's live environments, their steps and their rewards.

The contract users write to is :mod:`laminar.tools.env` (read its docstring first). Here is what
the data role does with it:

* **Lazily made, dropped when scored.** An episode's :class:`Environment` is made (and reset) when
  its first model turn ends, and forgotten when its trajectory is scored (or failed).
* **Steps are idempotent.** A rollout asks for turn ``k`` of an episode with the whole response so
  far. The episode remembers its last answer, so the same question again (a retry after a lost
  reply, or the rollout that repack moved a waiting episode to) gets the same answer without a
  second step; one lock per episode makes concurrent askers share one step.
* **Rebuilt by replay.** An episode whose live object is gone (the data role restarted) or behind
  the question (never happens unless a report raced) is rebuilt: a new environment, ``reset``, and
  the earlier actions stepped again (their observations are already in the response).
* **Bounded.** At most ``concurrency`` steps run at once (others wait, and the wait is measured);
  each step has ``step_timeout_s``. A step that raises, times out or answers an empty observation
  ends the episode with that reason: the trajectory completes and is recorded without a reward.
* **Rewards** are the sum of the step rewards up to ``done``; the trajectory's last action (ended
  by EOS or the budget, not a stop token) is stepped when the trajectory is scored.
* **Observations as the template writes them.** With a chat template in use (``data.chat_template``
  and ``env.observation_role``), an observation's tokens are the template's next turn after the
  model's: the rest of the assistant's turn, the observation as a user or tool message, and the
  generation prompt (:meth:`ChatTemplate.observation_ids`). Without one, the observation's text
  is encoded as it is. ``docs/agents.md``, ``docs/data.md``.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from laminar.runtime.clock import Clock
from laminar.runtime.errors import ConfigError
from laminar.tools.env import Environment, Step, load_environment, model_spans

from .api import EnvStepReply
from .chat import ChatTemplate
from .config import EnvConfig

_RECENT = 1000  # step latencies kept for the heartbeat's percentiles


class EpisodeError(Exception):
    """The episode cannot go on (its environment failed a step); the message says why."""


@dataclass
class _Episode:
    env: Environment | None = None  # None until reset (under the lock)
    stepped: int = 0  # actions stepped so far
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    answers: dict[int, EnvStepReply] = field(default_factory=dict)  # the last answer, by turn
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Episodes:
    """Every live episode of the data role (one per trajectory id)."""

    def __init__(
        self,
        config: EnvConfig,
        tokenizer: Any,
        registry: CollectorRegistry,
        clock: Clock,
        *,
        chat: ChatTemplate | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.env_class = load_environment(config.spec)
        self.tokenizer = tokenizer
        self.stop_ids = self._stop_ids(tokenizer)
        # observations become messages only with a template and a role for them
        self.chat = chat if config.observation_role is not None else None
        if self.chat is not None:  # a template that cannot write the turn fails now, not per step
            try:
                self.chat.observation_ids("observation", self._role, None)
            except Exception as exc:
                raise ConfigError(
                    f"environment {config.spec}: {self.chat.source} cannot render an observation "
                    f"as a {self._role!r} message after the model's turn ({type(exc).__name__}: "
                    f"{exc}); set data.env.observation_role to another role, or null to append "
                    "observations as plain text"
                ) from None
        self._live: dict[str, _Episode] = {}
        self._slots = asyncio.Semaphore(config.concurrency)
        self._recent: deque[float] = deque(maxlen=_RECENT)
        self.steps = self.errors = self.replays = self.waiting = 0
        self._m_step = Histogram(
            "laminar_env_step_seconds", "Environment step latency", registry=registry,
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300),
        )  # fmt: skip
        self._m_wait = Histogram(
            "laminar_env_wait_seconds", "Wait for a free environment slot", registry=registry,
            buckets=(0.001, 0.01, 0.1, 1, 10, 100),
        )  # fmt: skip
        self._m_errors = Counter(
            "laminar_env_step_errors", "Environment steps that failed (episode ended)",
            registry=registry,
        )  # fmt: skip

    @property
    def _role(self) -> str:
        return self.config.observation_role or "user"

    def _stop_ids(self, tokenizer: Any) -> list[int]:
        ids = []
        for text in self.env_class.stop:
            encoded = tokenizer.encode(text, add_special_tokens=False).ids
            if len(encoded) != 1:
                raise ConfigError(
                    f"environment {self.config.spec}: stop string {text!r} is {len(encoded)} "
                    "tokens of the model's tokenizer; each must be exactly one"
                )
            ids.append(encoded[0])
        return ids

    # -- the rollouts' questions -------------------------------------------------------------

    async def step(
        self, tid: str, record: dict[str, Any], tokens: list[int], env_spans: list[tuple[int, int]]
    ) -> EnvStepReply:
        """The answer to turn ``len(env_spans)`` of episode ``tid`` (see the module docstring)."""
        turn = len(env_spans)
        actions = model_spans(len(tokens), env_spans)
        if turn >= len(actions):
            return EnvStepReply(done=True, error="no model turn to step (the response ends with "
                                "the environment's turn)")  # fmt: skip
        episode = self._live.setdefault(tid, _Episode())
        async with episode.lock:
            if (answer := episode.answers.get(turn)) is not None:
                return answer
            t0 = self.clock.time()
            try:
                if episode.env is None or episode.stepped != turn:  # new, lost, out of step
                    await self._replay(episode, record, tokens, actions[:turn])
                observation, wait = await self._step(episode, self._text(tokens, actions[turn]))
                step_s = self.clock.time() - t0 - wait
                if episode.done:
                    answer = EnvStepReply(done=True, wait_s=wait, step_s=step_s)
                else:
                    ids = self._observation_ids(episode, observation, tokens[actions[turn][1] - 1])
                    answer = EnvStepReply(observation_token_ids=ids, wait_s=wait, step_s=step_s)
            except EpisodeError as exc:
                answer = EnvStepReply(done=True, error=str(exc))
            episode.answers = {turn: answer}  # only the newest turn can be asked again
            return answer

    # -- scoring -----------------------------------------------------------------------------

    async def final_reward(
        self, tid: str, record: dict[str, Any], tokens: list[int], env_spans: list[tuple[int, int]]
    ) -> tuple[float | None, str | None]:
        """The finished episode's reward (or why it has none): its remaining actions stepped (the
        last one, ended by EOS or the budget), then the episode forgotten."""
        actions = model_spans(len(tokens), env_spans)
        episode = self._live.setdefault(tid, _Episode())
        async with episode.lock:
            try:
                if episode.error is not None:
                    return None, episode.error
                if episode.env is None or episode.stepped < len(env_spans):
                    await self._replay(episode, record, tokens, actions[: len(env_spans)])
                for span in actions[episode.stepped :]:
                    if episode.done:
                        break
                    await self._step(episode, self._text(tokens, span))
            except EpisodeError as exc:
                return None, str(exc)
            finally:
                self._live.pop(tid, None)
        return episode.reward, None

    def forget(self, tid: str) -> None:
        self._live.pop(tid, None)

    # -- internals ---------------------------------------------------------------------------

    async def _replay(
        self,
        episode: _Episode,
        record: dict[str, Any],
        tokens: list[int],
        earlier: list[tuple[int, int]],
    ) -> None:
        """Make ``episode`` anew and step ``earlier`` actions again (their observations are
        already in the response)."""
        if earlier:
            self.replays += 1
        episode.env = self.env_class()
        episode.stepped, episode.reward, episode.done, episode.error = 0, 0.0, False, None
        await self._bounded(episode.env.reset(record), "reset")
        for span in earlier:
            await self._step(episode, self._text(tokens, span))

    async def _step(self, episode: _Episode, action: str) -> tuple[str, float]:
        """Step ``episode`` with ``action``: ``(observation, seconds waited for a slot)``. A
        failure is recorded on the episode and raised (:class:`EpisodeError`)."""
        assert episode.env is not None
        t0 = self.clock.time()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            wait = self.clock.time() - t0
            self._m_wait.observe(wait)
            t1 = self.clock.time()
            try:
                step = await self._bounded(episode.env.step(action), "step")
                if not isinstance(step, Step):
                    raise EpisodeError(
                        f"environment step returned {type(step).__name__}, not a Step"
                    )
                if not step.done and not step.observation:
                    raise EpisodeError("environment step returned an empty observation, not done")
            except EpisodeError as exc:
                episode.error = str(exc)
                self.errors += 1
                self._m_errors.inc()
                raise
            finally:
                seconds = self.clock.time() - t1
                self._m_step.observe(seconds)
                self._recent.append(seconds)
                self.steps += 1
        finally:
            self._slots.release()
        episode.stepped += 1
        episode.reward += float(step.reward)
        episode.done = step.done or episode.stepped >= self.config.max_turns
        return step.observation, wait

    async def _bounded(self, call: Awaitable[Any], what: str) -> Any:
        try:
            async with asyncio.timeout(self.config.step_timeout_s):
                return await call
        except TimeoutError:
            raise EpisodeError(
                f"environment {what} timed out after {self.config.step_timeout_s:g}s"
            ) from None
        except EpisodeError:
            raise
        except Exception as exc:  # the environment's own failure: this episode alone
            raise EpisodeError(f"environment {what} raised {type(exc).__name__}: {exc}") from None

    def _observation_ids(self, episode: _Episode, observation: str, last: int) -> list[int]:
        """The tokens that carry ``observation`` after a model turn ending with token ``last``.
        A template that fails on it ends the episode (recorded, as a failed step is)."""
        if self.chat is None:
            return list(self.tokenizer.encode(observation, add_special_tokens=False).ids)
        try:
            return self.chat.observation_ids(observation, self._role, last)
        except Exception as exc:  # this observation's content: this episode alone
            episode.error = (
                f"the chat template could not render the observation: {type(exc).__name__}: {exc}"
            )
            raise EpisodeError(episode.error) from None

    def _text(self, tokens: list[int], span: tuple[int, int]) -> str:
        return str(self.tokenizer.decode(tokens[span[0] : span[1]], skip_special_tokens=True))

    def stats(self) -> dict[str, float]:
        recent = sorted(self._recent)
        p50 = statistics.median(recent) if recent else 0.0
        p99 = recent[min(len(recent) - 1, int(0.99 * len(recent)))] if recent else 0.0
        return {
            "env_live": float(len(self._live)),
            "env_waiting": float(self.waiting),
            "env_steps": float(self.steps),
            "env_errors": float(self.errors),
            "env_replays": float(self.replays),
            "env_step_p50_s": p50,
            "env_step_p99_s": p99,
        }
