"""Held-out accuracy of the live policy, in the trainer's own process (``trainer.eval``).

Its own small module because every rank of a sharded group runs it (:mod:`.dp`): the model's
forwards are collectives there, so each rank generates the same prompts in step, and rank 0's
figures are the ones reported. The task, its records and the tokenizer load on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import EvalConfig


class Evaluator:
    def __init__(self, config: EvalConfig, model_dir: str) -> None:
        self.config, self.model_dir = config, model_dir
        self._loaded: tuple[Any, Any, Any] | None = None  # (task, records, tokenizer)

    def __call__(
        self,
        model: Any,
        version: int,
        *,
        synced: bool = False,
        stop: Callable[[], bool] | None = None,
    ) -> Any:
        """The evaluation's :class:`~laminar.recipe.evaluate.EvalResult`; ``stop`` is asked
        at every decoding step and gives up with ``EvalStopped`` (see there)."""
        from laminar.recipe.evaluate import eval_records, evaluate_model
        from laminar.recipe.model import load_tokenizer
        from laminar.recipe.tasks import load_task

        e = self.config
        if self._loaded is None:
            task = load_task(e.task)
            records = eval_records(task, e.n, e.seed, e.data)
            self._loaded = (task, records, load_tokenizer(self.model_dir))
        task, records, tok = self._loaded
        return evaluate_model(
            task, model, tok, records, e.batch_size, name=f"v{version}", synced=synced, stop=stop
        )
