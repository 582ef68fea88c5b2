"""The RL math: advantages, packing alignment, token logprobs and the policy loss.

Loss tests build ``[1, T]`` tensors by hand so that each token's ratio, advantage and weight is
known exactly; alignment and the data-parallel property run through a tiny random Qwen2.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from laminar.rl import (
    LossStats,
    PackedBatch,
    PolicyLossConfig,
    grpo_advantages,
    pack,
    policy_loss,
    token_logprobs,
)
from laminar.trajectory import Trajectory
from tests.support.models import tiny_qwen2


def traj(prompt: list[int], response: list[int], logprobs: list[float] | None = None) -> Trajectory:
    return Trajectory(
        trajectory_id="p/0",
        prompt_id="p",
        sample_index=0,
        prompt_token_ids=prompt,
        response_token_ids=response,
        logprobs=logprobs if logprobs is not None else [-1.0] * len(response),
        version=0,
        finish_reason="stop",
        queued_at=0.0,
        started_at=0.0,
        finished_at=0.0,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    import transformers

    path = tiny_qwen2(tmp_path_factory.mktemp("qwen2"))
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()


# --- advantages ---------------------------------------------------------------------------------


def test_grpo_groups_have_zero_mean_unit_std_and_are_independent() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 10.0, 0.5, 20.0, 30.0])
    groups = ["a", "a", "a", "b", "a", "b", "b"]
    adv = grpo_advantages(rewards, groups)
    for g in "ab":
        sel = torch.tensor([x == g for x in groups])
        assert adv[sel].mean().abs() < 1e-6
        assert adv[sel].std(correction=0) == pytest.approx(1.0, abs=1e-5)
    # Changing group b's rewards leaves group a untouched.
    other = rewards.clone()
    other[[3, 5, 6]] = torch.tensor([-5.0, 7.0, 100.0])
    sel_a = torch.tensor([x == "a" for x in groups])
    assert torch.equal(grpo_advantages(other, groups)[sel_a], adv[sel_a])


def test_grpo_constant_group_and_singleton_give_zero() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0, 1.0, 0.0])
    adv = grpo_advantages(rewards, ["c", "c", "c", "s", "x", "x"])
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4:].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_dr_grpo_only_centres() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 3.0, 10.0]), ["a", "a", "b"], normalize_std=False)
    assert adv.tolist() == [-1.0, 1.0, 0.0]


def test_grpo_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(torch.tensor([1.0, 2.0]), ["a"])


# --- pack and token_logprobs ---------------------------------------------------------------------


def test_pack_places_response_values_at_response_positions() -> None:
    b = pack([traj([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3]), traj([5, 6, 7], [4])], [2.0, -1.0], 0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 4, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]]
    assert b.behaviour_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert b.advantages.tolist() == [[0, 0, 2, 2, 2], [0, 0, 0, -1, 0]]
    assert b.n_tokens == 4
    sub = b.select([1])
    assert sub.input_ids.tolist() == [[5, 6, 7, 4, 0]] and sub.n_tokens == 1
    assert b.select(slice(0, 1)).n_tokens == 3


def test_environment_turns_are_context_not_loss() -> None:
    """A multi-turn episode: model tokens 7 8, the environment's 50 51 52 (tool output), model
    token 9. The environment's span is read (attention) but has no loss, so no gradient and no
    weight in a token mean; the model's three tokens carry it all."""
    episode = traj([5], [7, 8, 50, 51, 52, 9], [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5])
    episode = episode.model_copy(update={"env_spans": [(2, 5)]})
    assert episode.model_tokens() == 3
    b = pack([episode], [1.0])
    assert b.attention_mask.tolist() == [[1] * 7]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0, 1]] and b.n_tokens == 3
    logp = torch.zeros(1, 7, requires_grad=True)
    old = torch.zeros(1, 7)  # on-policy: ratio 1, nothing clipped
    loss, _ = policy_loss(logp, old, b.behaviour_logprobs, b.advantages, b.loss_mask,
                          PolicyLossConfig(), total_tokens=b.n_tokens)  # fmt: skip
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, 3:6].tolist() == [0.0, 0.0, 0.0]
    assert logp.grad[0, [1, 2, 6]].tolist() == pytest.approx([-1 / 3] * 3)


@pytest.mark.parametrize(
    "spans", [[(2, 2)], [(3, 1)], [(0, 7)], [(2, 4), (3, 5)], [(4, 5), (1, 2)]]
)
def test_bad_environment_spans_are_refused(spans: list[tuple[int, int]]) -> None:
    with pytest.raises(ValidationError, match="env_spans"):
        Trajectory.model_validate(
            {**traj([5], [1, 2, 3, 4, 5, 6]).model_dump(), "env_spans": spans}
        )


def test_pack_validates() -> None:
    bad = traj([1], [2, 3])
    bad.logprobs.append(-1.0)  # mutated after validation
    with pytest.raises(ValueError, match="2 response tokens but 3 logprobs"):
        pack([bad], [1.0])
    with pytest.raises(ValueError, match="advantages"):
        pack([traj([1], [2])], [1.0, 2.0])
    with pytest.raises(ValueError, match="empty prompt"):
        pack([traj([], [2])], [1.0])


def _manual_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int]
) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[t - 1, ids[0, t]] for t in range(len(prompt), ids.shape[1])])


@torch.no_grad()
def test_token_logprobs_align_with_unpadded_per_sequence_computation(
    model: torch.nn.Module,
) -> None:
    rows = [([1, 5, 9], [10, 11, 12, 2]), ([1, 7], [3]), ([1, 4, 4, 4, 8], [20, 21])]
    batch = pack([traj(p, r) for p, r in rows], [1.0, 1.0, 1.0], pad_id=0)
    logp, ent = token_logprobs(model, batch, with_entropy=True)
    assert logp.shape == batch.input_ids.shape and ent is not None
    for row, (p, r) in enumerate(rows):
        got = logp[row, len(p) : len(p) + len(r)]
        torch.testing.assert_close(got, _manual_logprobs(model, p, r), atol=1e-5, rtol=0)
        assert logp[row, 0] == 0 and (logp[row, len(p) + len(r) :] == 0).all()
    assert (ent[batch.loss_mask > 0] > 0).all()
    assert (ent[batch.loss_mask > 0] <= math.log(64) + 1e-5).all()
    # Padding does not change results: the same rows with a different pad id and extra width.
    wide = pack([traj(p, r) for p, r in rows] + [traj([1] * 12, [3])], [1.0] * 4, pad_id=33)
    logp_wide, _ = token_logprobs(model, wide)
    mask = batch.loss_mask > 0
    torch.testing.assert_close(logp_wide[:3, : logp.shape[1]][mask], logp[mask], atol=1e-5, rtol=0)


@torch.no_grad()
def test_token_logprobs_temperature(model: torch.nn.Module) -> None:
    batch = pack([traj([1, 5], [6, 7])], [1.0])
    logits = model(input_ids=batch.input_ids).logits[0, :-1] / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[0, 1:, None]).squeeze(-1)
    got, _ = token_logprobs(model, batch, temperature=0.7)
    torch.testing.assert_close(got[0, 1:], want, atol=1e-5, rtol=0)


# --- losses ---------------------------------------------------------------------------------------


def row(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.float32)


def loss_of(ratios: list[float], adv: list[float], cfg: PolicyLossConfig, **kw):
    """Loss with logp = 0 (leaf) and old = -log(ratio), so exp(logp - old) = ratio."""
    logp = torch.zeros(1, len(ratios), requires_grad=True)
    old = -torch.log(torch.tensor([ratios]))
    behaviour = kw.pop("behaviour", old)
    mask = kw.pop("mask", torch.ones(1, len(ratios)))
    total = kw.pop("total_tokens", float(mask.sum()))
    loss, stats = policy_loss(logp, old, behaviour, torch.tensor([adv]), mask, cfg,
                              total_tokens=total, **kw)  # fmt: skip
    loss.backward()
    return loss, stats, logp.grad[0]


def test_on_policy_loss_is_minus_mean_advantage() -> None:
    adv = [1.5, -0.5, 2.0, 0.0]
    loss, stats, grad = loss_of([1.0] * 4, adv, PolicyLossConfig())
    assert loss.item() == pytest.approx(-sum(adv) / 4)
    means = stats.as_means()
    assert means["clip_frac"] == 0 and means["ratio"] == pytest.approx(1.0)
    assert means["mismatch_kl"] == 0 and means["is_weight"] == 1.0
    torch.testing.assert_close(grad, -torch.tensor(adv) / 4)


def test_clip_higher_is_asymmetric() -> None:
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    # ratio 1.5 (A>0) and 0.75 (A<0) are clipped: no gradient. 1.25 (A>0) and 0.75 (A>0) are not.
    _, stats, grad = loss_of([1.5, 0.75, 1.25, 0.75], [2.0, -1.0, 1.0, 1.0], cfg)
    assert grad[0] == 0 and grad[1] == 0
    assert grad[2].item() == pytest.approx(-1.25 / 4) and grad[3].item() == pytest.approx(-0.75 / 4)
    assert stats.clipped == 2 and stats.as_means()["clip_frac"] == 0.5
    # With a symmetric 0.2 the 1.25 token is clipped too.
    _, stats, grad = loss_of([1.25], [1.0], PolicyLossConfig(clip_high=0.2))
    assert grad[0] == 0 and stats.clipped == 1


def test_tis_weight_is_truncated_at_cap() -> None:
    cfg = PolicyLossConfig(off_policy="tis", tis_cap=2.0)
    behaviour = torch.log(torch.tensor([[1 / 5, 1 / 1.5]]))  # old = 0: weights 5 and 1.5
    loss, stats, grad = loss_of([1.0, 1.0], [1.0, 1.0], cfg, behaviour=behaviour)
    assert loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    torch.testing.assert_close(grad, torch.tensor([-1.0, -0.75]))
    assert stats.is_weight_sum == pytest.approx(3.5)
    assert stats.mismatch_kl_sum == pytest.approx(math.log(1 / 5) + math.log(1 / 1.5))
    # The same batch without correction ignores behaviour logprobs in the loss.
    loss, _, _ = loss_of([1.0, 1.0], [1.0, 1.0], PolicyLossConfig(), behaviour=behaviour)
    assert loss.item() == pytest.approx(-1.0)


def test_decoupled_weights_and_cap_masks_tokens() -> None:
    behaviour = torch.log(torch.tensor([[1 / 5, 1 / 1.5, 1.0]]))
    loss, stats, grad = loss_of([1.0] * 3, [1.0] * 3, PolicyLossConfig(off_policy="decoupled"),
                                behaviour=behaviour)  # fmt: skip
    assert loss.item() == pytest.approx(-(5 + 1.5 + 1) / 3) and stats.masked_out == 0
    cfg = PolicyLossConfig(off_policy="decoupled", decoupled_cap=3.0)
    loss, stats, grad = loss_of([1.0] * 3, [1.0] * 3, cfg, behaviour=behaviour)
    assert loss.item() == pytest.approx(-(1.5 + 1) / 3)
    assert grad[0] == 0 and stats.masked_out == 1 and stats.tokens == 3
    assert stats.as_means()["masked_frac"] == pytest.approx(1 / 3)


def test_kl_and_entropy_terms() -> None:
    cfg = PolicyLossConfig(kl_coef=0.5, entropy_coef=0.1)
    ref = row(-1.0, 0.0)  # logp = 0: d = -1 -> k3 = e^-1 + 1 - 1; d = 0 -> 0
    entropy = row(2.0, 4.0)
    loss, stats, _ = loss_of([1.0, 1.0], [0.0, 0.0], cfg, ref_logprobs=ref, entropy=entropy)
    k3 = math.exp(-1)
    assert loss.item() == pytest.approx((0.5 * k3 - 0.1 * 6.0) / 2)
    assert stats.kl_ref_sum == pytest.approx(k3) and stats.entropy_sum == pytest.approx(6.0)


def test_masked_positions_contribute_nothing() -> None:
    mask = row(0.0, 1.0, 1.0, 0.0)
    behaviour = row(0.0, 0.0, 0.0, -50.0)  # huge weight outside the mask must not leak
    cfg = PolicyLossConfig(off_policy="decoupled")
    loss, stats, grad = loss_of([9.0, 1.0, 1.0, 1e-3], [5.0, 1.0, 1.0, 5.0], cfg, mask=mask,
                                behaviour=behaviour)  # fmt: skip
    assert loss.item() == pytest.approx(-1.0) and stats.tokens == 2
    assert grad[0] == 0 and grad[3] == 0 and torch.isfinite(grad).all()


def test_seq_mean_weighs_every_response_equally() -> None:
    """Two responses, 1 and 3 tokens: token_mean gives each token 1/4, seq_mean 1/(2 len)."""
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    cfg = PolicyLossConfig(aggregation="seq_mean")
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, cfg,
                              total_tokens=4.0, total_sequences=2.0)  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and stats.tokens == 4  # (-1 + 1) / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))
    with pytest.raises(ValueError, match="total_sequences"):
        policy_loss(logp, logp, logp, adv, mask, cfg, total_tokens=4.0)


def test_split_batch_gradients_sum_to_full_batch_gradient(model: torch.nn.Module) -> None:
    """Two halves (two DP ranks) normalised by the global token count sum to the full update."""
    g = torch.Generator().manual_seed(0)
    trajs = [
        traj([1, 3 + i], torch.randint(3, 64, (2 + 3 * i,), generator=g).tolist(),
             (-torch.rand(2 + 3 * i, generator=g)).tolist())
        for i in range(4)
    ]  # fmt: skip
    batch = pack(trajs, [1.0, -0.5, 2.0, -1.5])
    cfg = PolicyLossConfig(off_policy="tis", kl_coef=0.1, entropy_coef=0.01)
    with torch.no_grad():
        old, _ = token_logprobs(model, batch)
        behaviour = old + 0.5 * (torch.rand(old.shape, generator=g) - 0.5)  # weights ~[0.8, 1.3]
        old = old + (torch.rand(old.shape, generator=g) - 0.5)  # ratios in [0.6, 1.6]: some clip

    def grads(part: PackedBatch, rows: slice) -> tuple[list[torch.Tensor], LossStats]:
        model.zero_grad()
        logp, ent = token_logprobs(model, part, with_entropy=True)
        loss, stats = policy_loss(logp, old[rows], behaviour[rows], part.advantages,
                                  part.loss_mask, cfg, total_tokens=batch.n_tokens, entropy=ent,
                                  ref_logprobs=old[rows] - 0.1)  # fmt: skip
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], stats

    full, full_stats = grads(batch, slice(None))
    a, stats_a = grads(batch.select(slice(0, 2)), slice(0, 2))
    b, stats_b = grads(batch.select(slice(2, 4)), slice(2, 4))
    model.zero_grad()
    for f, x, y in zip(full, a, b, strict=True):
        torch.testing.assert_close(x + y, f, atol=1e-6, rtol=1e-5)
    merged = stats_a.merge(stats_b)
    assert merged.tokens == full_stats.tokens == batch.n_tokens
    assert merged.clipped == full_stats.clipped > 0
    assert LossStats.from_tensor(merged.as_tensor()) == merged


def test_config_validates() -> None:
    with pytest.raises(ValidationError):
        PolicyLossConfig(tis_cap=0.0)
    with pytest.raises(ValidationError):
        PolicyLossConfig(off_policy="vtrace")
    with pytest.raises(ValidationError):
        PolicyLossConfig(kl_coef=-1.0)
    with pytest.raises(ValidationError):
        PolicyLossConfig(clip_hi=0.3)


def test_cispo_keeps_the_gradient_ppo_clips_bounded_by_its_weight() -> None:
    """Hand-computed: ratios 1.5, 6 and 0.5 with advantages 1, 1 and -2. PPO (0.2/0.28) gives the
    last two no gradient (outside the trust region on the side the advantage pushes); CISPO's
    gradient is -min(r, 1 + 4) A / n for every token: -1.5/3, -5/3 and +1/3."""
    ratios, adv = [1.5, 6.0, 0.5], [1.0, 1.0, -2.0]
    _, _, ppo = loss_of(ratios, adv, PolicyLossConfig())
    assert ppo[1] == 0 and ppo[2] == 0
    loss, stats, grad = loss_of(ratios, adv, PolicyLossConfig(objective="cispo"))
    torch.testing.assert_close(grad, torch.tensor([-1.5, -5.0, 1.0]) / 3)
    assert loss.item() == 0.0  # logp = 0: the value is -w A logp
    assert stats.clipped == 1  # the ratio of 6 was clipped to 5
    # the value: -w A logp with logp = log(0.5) and old = log(0.25) (r = 2): -2 * 1 * log(0.5)
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25]]))
    cfg = PolicyLossConfig(objective="cispo")
    value, _ = policy_loss(logp, old, old, torch.tensor([[1.0]]), torch.ones(1, 1), cfg,
                           total_tokens=1.0)  # fmt: skip
    assert value.item() == pytest.approx(-2.0 * math.log(0.5))


def test_topr_is_plain_on_positives_and_truncated_on_negatives() -> None:
    """Three trajectories of two tokens. A positive one far off-policy (behaviour ratio e^6):
    weight 1, a plain REINFORCE step. A negative one with trajectory ratio 1/4: weight 1/4. A
    negative one with trajectory ratio 2: weight min(1, 2) = 1."""
    logp = torch.zeros(3, 2, requires_grad=True)
    half = math.log(2) / 2
    behaviour = torch.tensor([[-3.0, -3.0], [math.log(2), math.log(2)], [-half, -half]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    cfg = PolicyLossConfig(objective="topr")
    loss, stats = policy_loss(logp, torch.zeros(3, 2), behaviour, adv, torch.ones(3, 2), cfg,
                              total_tokens=6.0)  # fmt: skip
    loss.backward()
    want = torch.tensor([[-1.0, -1.0], [0.25, 0.25], [1.0, 1.0]]) / 6
    torch.testing.assert_close(logp.grad, want)
    assert stats.clipped == 2  # the two tokens of the truncated negative trajectory


def test_objectives_take_the_off_policy_weight_and_refuse_unknowns() -> None:
    """A TIS weight multiplies CISPO's per-token loss like PPO's; a misspelt objective is a
    config error naming the choices."""
    behaviour = torch.log(torch.tensor([[1 / 5]]))  # old = 0: TIS weight min(5, 2) = 2
    cfg = PolicyLossConfig(objective="cispo", off_policy="tis", tis_cap=2.0)
    _, _, grad = loss_of([1.0], [1.0], cfg, behaviour=behaviour)
    assert grad[0].item() == pytest.approx(-2.0)
    with pytest.raises(ValidationError, match="ppo"):
        PolicyLossConfig(objective="grpo")


def test_the_package_names_load_from_their_modules() -> None:
    """``laminar.rl`` loads its names lazily (its config module must not cost a torch import):
    every exported name resolves to its defining module's object, and nothing else does."""
    import importlib

    import laminar.rl as rl

    assert sorted(rl.__all__) == sorted(rl._HOMES)
    for name, home in rl._HOMES.items():
        module = importlib.import_module(f"laminar.rl.{home}")
        assert getattr(rl, name) is getattr(module, name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rl.nope  # noqa: B018
