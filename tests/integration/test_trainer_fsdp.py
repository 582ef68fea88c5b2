"""FSDP2 (``sharding: fsdp``) beyond one update: checkpoints, resuming, publishing, memory, an
evaluation stopped half-way.

The update itself is checked against one rank in ``test_trainer_dp.py``; here a 2-rank sharded
group's checkpoint must hold exactly what a replicated trainer's would (weights and AdamW moments),
resume at another world size and sharding, stage its weights for the relays while the next step
trains (rows written into a shared buffer, or sent to rank 0), and keep about half of the
replicated trainer's state per rank. And a trainer told to stop while its group evaluates takes
every rank out of the evaluation together (``roles/trainer/wire.GroupStop``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from laminar.recipe.episodes import EvalStopped
from laminar.recipe.model import ModelShape, init_model
from laminar.recipe.tasks import load_task
from laminar.rl import grpo_advantages, pack
from laminar.rl.batch import PackedBatch
from laminar.roles.trainer.checkpoint import TrainingState, load_training_state, save_checkpoint
from laminar.roles.trainer.compute import PolicyTrainer
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.dp import DataParallelGroup
from laminar.roles.trainer.evaluator import Evaluator
from laminar.transport.shm import SharedBuffer
from laminar.weights.manifest import plan_specs
from laminar.weights.tensors import copy_into, plan_tensors, tensors_from

from ..support.models import tiny_llama
from .test_trainer_dp import batch

pytestmark = pytest.mark.integration

ARITH = Path(__file__).resolve().parents[2] / "examples" / "arith"


def config(model: Path, world: int, sharding: str, **extra: object) -> TrainerConfig:
    return TrainerConfig(
        **extra,  # type: ignore[arg-type]
        model=str(model),
        data_parallel=world,
        sharding=sharding,
        threads_per_rank=1,
        batch={"prompts": 4, "samples": 4, "mini_batches": 2, "micro_batch_rows": 3},
        optim={"name": "adamw", "lr": 1e-3},
        loss={"off_policy": "tis"},
    )


def packed(seed: int) -> PackedBatch:
    trajectories = batch(seed)
    adv = grpo_advantages(
        torch.tensor([t.reward for t in trajectories]), [t.prompt_id for t in trajectories]
    )
    return pack(trajectories, adv.tolist())


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() < 0.02 * 1e-3, name  # see test_trainer_dp


def test_sharded_checkpoint_resume_publish_and_memory(tmp_path: Path) -> None:
    # the other family, with the head tied to the embedding: one parameter under two names,
    # read once from the file, sharded once, written back under both
    model = tiny_llama(tmp_path / "model", tied=True)
    one = PolicyTrainer(config(model, 1, "replicate"))
    one.train(packed(0))
    group = DataParallelGroup(config(model, 2, "fsdp"), timeout_s=60)
    try:
        group.train(packed(0))
        # memory: each rank keeps about half of the parameters, gradients and Adam moments
        sharded, replicated = group.state_bytes(), one.state_bytes()
        for kind in ("params", "grads", "optimizer"):
            assert sharded[kind] <= 0.55 * replicated[kind], (kind, sharded, replicated)
        # publishing, nothing gathered, while the next step trains: each rank writing its own
        # rows into a shared buffer (ranks on one host), or sending them to rank 0 over the
        # group's staging group (ranks on other hosts); either version holds the weights it
        # was staged with, not the next step's
        specs = group.weight_specs()
        manifest = plan_specs(specs, 1)
        assert manifest == plan_tensors(one.named_weights(), 1)
        # the tied head is published once, under the embedding's name, as the checkpoint has it
        names = [name for name, _, _ in specs]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        assert group.needs_segment
        segment = SharedBuffer(manifest.total_bytes)
        try:
            copying = group.copy_out(manifest, segment.name, segment.view)
            result = group.train(packed(1))
            copying.result(timeout=60)
            assert result.weights_wait_s >= 0.0
            by_rows = {k: v.clone() for k, v in tensors_from(manifest, segment.view)}
        finally:
            segment.close()
        close(by_rows, dict(one.named_weights()))
        one.train(packed(1))
        group.rows_by_segment = False  # as served ranks on other hosts do
        assert not group.needs_segment
        buffer = np.zeros(manifest.total_bytes, dtype=np.uint8)
        copying = group.copy_out(manifest, None, memoryview(buffer))
        group.train(packed(2))
        copying.result(timeout=60)
        sent = {k: v.clone() for k, v in tensors_from(manifest, memoryview(buffer))}
        close(sent, dict(one.named_weights()))
        one.train(packed(2))
        # and gathered whole, one tensor at a time (what tests and evaluation read)
        copy_into(group.weights(), manifest, memoryview(buffer))
        staged = {k: v.clone() for k, v in tensors_from(manifest, memoryview(buffer))}
        close(staged, dict(one.named_weights()))
        # a checkpoint: the whole weights and the name-keyed optimizer state, on rank 0
        model_state, optim_state = group.training_state()
        path = save_checkpoint(
            tmp_path / "ckpt", TrainingState(3, 48), group.trainer.model, optim_state, model,
            keep=2, saved_at=0.0, model_state=model_state,
        )  # fmt: skip
    finally:
        group.close()
    weights, moments = load_training_state(path)
    close(weights, one.training_state()[0])
    mine = one.training_state()[1]["state"]
    assert set(moments["state"]) == set(mine)  # keyed by parameter name
    for name, state in mine.items():
        close({"m": moments["state"][name]["exp_avg"]}, {"m": state["exp_avg"]})
    # resume the sharded checkpoint sharded and replicated: both take the same next step
    one.train(packed(3))
    resumed = DataParallelGroup(config(model, 2, "fsdp"), state_path=str(path), timeout_s=60)
    try:
        resumed.train(packed(3))
        close(dict(resumed.weights()), dict(one.named_weights()))
    finally:
        resumed.close()
    single = DataParallelGroup(config(model, 1, "replicate"), state_path=str(path))
    single.train(packed(3))
    close(dict(single.weights()), dict(one.named_weights()))


def test_a_sharded_evaluation_told_to_stop_ends_on_every_rank_together(tmp_path: Path) -> None:
    """Every rank of a sharded group generates the evaluation's prompts in step (each forward
    pass gathers the weights), so rank 0 alone could not leave it half-way: the trainer's stop
    (a `laminar run` stopped during an evaluation, tens of seconds on a CPU) had to wait for its
    end, past the stop's grace. Told at its first decoding step, rank 0 gives up with
    ``EvalStopped``; the other rank leaves after the same ``generate`` call (the next evaluation
    runs in step, to its end), and both stop cleanly."""
    task = load_task(str(ARITH))
    model = init_model(task.alphabet, tmp_path / "model", ModelShape(), seed=0)
    # one-operation problems: short budgets, for the untrained model writes to its budget
    short = [r for r in task.test_records(200) if r["steps"] == 1][:4]
    records = tmp_path / "short.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in short))
    eval_ = {"task": str(ARITH), "data": str(records), "n": 4, "batch_size": 2}
    cfg = config(model, 2, "fsdp", eval=eval_)
    assert cfg.eval is not None
    evaluator = Evaluator(cfg.eval, cfg.model)
    group = DataParallelGroup(cfg, timeout_s=60)
    ranks = list(group.procs)
    asked: list[int] = []

    def told() -> bool:
        asked.append(1)
        return True

    try:
        with pytest.raises(EvalStopped):
            group.evaluate(evaluator, 0, stop=told)
        assert asked  # at a decoding step
        assert group.evaluate(evaluator, 1).n == 4  # still in step: a whole evaluation
    finally:
        group.close()
    assert [p.exitcode for p in ranks] == [0]  # rank 1 left its evaluation, not its loop
