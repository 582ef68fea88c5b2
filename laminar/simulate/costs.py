"""What the simulator charges for GPU work, from the paper and first principles: pure functions.

Every constant has its source beside it. The paper's setting (``shared/paper-notes.md`` §6.1):
H800-80GB GPUs, 8 per machine, NVLink 400 GB/s, 8 x 400 Gbps between machines; Qwen2.5 7B / 32B /
72B in bf16; rollout TP 1 (7B; 2 for the verl-based baselines), 4 (32B), 8 (72B).

**Decode** is a roofline (:meth:`Roofline.decode_step`): a step reads the weights once and the
whole KV cache of its batch once (memory-bound), or does ``2 N`` FLOPs per sequence
(compute-bound), whichever takes longer, plus a tensor-parallel all-reduce per layer. With the
stated efficiencies it reproduces the paper's measured 7B table (Fig. 4: 7 / 12.5 / 18 / 30 ms at
batch 1 / 64 / 128 / 256, context 4096) within 10% (a test holds it there), and the same formula
with the 32B and 72B shapes gives their step times.

**Eager decoding** (an assumption, fitted): the verl-based systems (verl, one-step, stream,
RollPacker) run vLLM as verl configures it by default, ``enforce_eager: True`` (no CUDA graphs,
so the cache engine can be freed between rollouts). A step then costs at least the host's time to
launch its kernels, :data:`EAGER_STEP_S`. The figure is fitted to the paper's verl plateau (7B:
about 0.48e5 tokens/s from 64 GPUs on, iterations of ~550 s, which a 16K-token straggler at
about 30 ms per step explains; 32B and 72B plateau alike) and is not measured here.

**Prefill** (and re-prefill after an abort or a migration without KV) is compute-bound:
``2 N`` FLOPs per token at ``prefill_mfu``.

**Training** is ``8 N`` FLOPs per token (forward + backward + the forward that recomputes the old
policy's logprobs; GRPO, no reference model) at 35% MFU of the trainer's GPUs, plus a fixed
cost per update (:func:`train_cost`: the sim trainer's own :class:`laminar.engines.costmodel.
TrainCostModel`).

**Weights** move over the relay chain in the paper's pipelined-chunk model (Appendix D):
``T(p, k) = (p + k - 2) (M / k T_byte + T_start)`` at the optimal ``k``; a baseline's global
NCCL broadcast is charged the same bandwidth term plus a ring's latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from laminar.engines.costmodel import H800_BF16_FLOPS, TrainCostModel

# -- hardware: one H800-80GB (NVIDIA H800 SXM datasheet) ------------------------------------------

H800_HBM_BPS = 3.35e12  # HBM3 bytes/s
H800_MEMORY = 80 * 2**30
NVLINK_BPS = 400e9  # bytes/s within a machine (paper §6.1)
NIC_BPS = 8 * 400e9 / 8  # 8 x 400 Gbps per machine, in bytes/s (paper §6.1)
GPUS_PER_MACHINE = 8


#: The floor of an eager (no CUDA graph) decode step: see the module docstring.
EAGER_STEP_S = 0.03


@dataclass(frozen=True)
class ModelShape:
    """A decoder's size as the costs need it (Qwen2.5 configs, ``config.json`` of each model)."""

    name: str
    params: float  # N
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bf16 (7B: 2 x 28 x 4 x 128 x 2 = 56 KiB)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


QWEN25_7B = ModelShape("7B", 7.62e9, layers=28, kv_heads=4, head_dim=128, hidden=3584)
QWEN25_32B = ModelShape("32B", 32.8e9, layers=64, kv_heads=8, head_dim=128, hidden=5120)
QWEN25_72B = ModelShape("72B", 72.7e9, layers=80, kv_heads=8, head_dim=128, hidden=8192)
MODELS = {m.name: m for m in (QWEN25_7B, QWEN25_32B, QWEN25_72B)}


@dataclass(frozen=True)
class Roofline:
    """Step times of one rollout engine (``tp`` GPUs) serving ``model``.

    ``hbm_efficiency`` and ``decode_mfu``: the fractions of peak bandwidth and FLOP/s a decode
    step reaches; ``step_overhead_s``: per-step fixed cost (scheduler, sampling, kernel launches);
    ``allreduce_s``: per-layer TP all-reduce latency (NVLink), paid twice per layer when tp > 1;
    ``eager_step_s``: without CUDA graphs (vLLM's ``enforce_eager``) a step cannot be shorter
    than the host's time to launch its kernels (0: CUDA graphs).
    The defaults make the 7B shape match Fig. 4 (see the module docstring)."""

    model: ModelShape
    tp: int = 1
    hbm_efficiency: float = 0.72
    decode_mfu: float = 0.35
    prefill_mfu: float = 0.5
    step_overhead_s: float = 0.0004
    allreduce_s: float = 8e-6
    memory_fraction: float = 0.9  # of each GPU's memory that vLLM may use
    eager_step_s: float = 0.0

    def decode_step(self, batch: int, context_tokens: float) -> float:
        """Seconds of one decode step of ``batch`` sequences holding ``context_tokens`` tokens of
        KV cache in all."""
        if batch <= 0:
            return 0.0
        bandwidth = self.tp * H800_HBM_BPS * self.hbm_efficiency
        memory = (
            self.model.weight_bytes + context_tokens * self.model.kv_bytes_per_token
        ) / bandwidth
        compute = 2 * self.model.params * batch / (self.tp * H800_BF16_FLOPS * self.decode_mfu)
        comm = 2 * self.model.layers * self.allreduce_s if self.tp > 1 else 0.0
        return max(memory, compute, self.eager_step_s) + comm + self.step_overhead_s

    def prefill(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` tokens (compute-bound)."""
        if tokens <= 0:
            return 0.0
        return 2 * self.model.params * tokens / (self.tp * H800_BF16_FLOPS * self.prefill_mfu)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the engine holds: what is left of its GPUs' memory after the
        weights (and vLLM's share), over the bytes per token."""
        free = self.tp * H800_MEMORY * self.memory_fraction - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def roofline_batch(self, context_per_seq: float = 4096) -> int:
        """B of Algorithm 1, the most sequences that decode with little latency increase: the
        largest batch whose step takes at most twice a single sequence's, at a typical context
        per sequence (7B: 64, where Fig. 4 stops being flat)."""
        single = self.decode_step(1, context_per_seq)
        lo, hi = 1, 1 << 16
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_step(mid, mid * context_per_seq) <= 2 * single:
                lo = mid
            else:
                hi = mid - 1
        return lo


def train_cost(model: ModelShape, gpus: int) -> TrainCostModel:
    """One actor update of ``model`` on ``gpus`` GPUs: ``8 N`` FLOPs per token at 35% MFU (the
    paper's assumption), plus 5 s per update (optimizer step, gradient reduce,
    offload); :meth:`TrainCostModel.train_time` gives the seconds."""
    return TrainCostModel(flops_per_token=8 * model.params, gpus=gpus, mfu=0.35, base_s=5.0)


#: The relay chain's effective link rate and per-chunk start cost, fitted to the paper's Fig. 18
#: (measured broadcast latency of 32B and 72B to 4..128 machines; the best fit of the formula, all
#: 12 points within 13%): 0.47 / 1.00 s at 4 machines and 0.81 / 1.49 s at 128 (the paper's
#: ~0.42 / 0.95 and ~0.73 / 1.62; the paper's grow with log(machines), the formula with its square
#: root). The rate is 39% of the 8 x 400 Gbps NICs: a relay stages each chunk in host memory.
RELAY_LINK_BPS = 155e9
RELAY_CHUNK_START_S = 5e-4


def chain_broadcast(
    nbytes: float,
    nodes: int,
    link_bps: float = RELAY_LINK_BPS,
    start_s: float = RELAY_CHUNK_START_S,
) -> float:
    """The relay chain's time to deliver ``nbytes`` from the master to the last of ``nodes``
    (master included), pipelined in the optimal number of chunks (paper Appendix D)."""
    t_byte = 1.0 / link_bps
    if nodes <= 1:
        return 0.0
    if nodes == 2:
        return nbytes * t_byte + start_s
    k = max(1, round(math.sqrt((nodes - 2) * nbytes * t_byte / start_s)))
    return (nodes + k - 2) * (nbytes / k * t_byte + start_s)


def ring_broadcast(nbytes: float, gpus: int, link_bps: float = NIC_BPS / GPUS_PER_MACHINE) -> float:
    """A global NCCL broadcast of the weights to ``gpus`` GPUs (a baseline's weight sync):
    bandwidth-bound per GPU link, plus a latency that grows with the ring."""
    if gpus <= 1:
        return 0.0
    return nbytes / link_bps + gpus * 20e-6


def kv_transfer(
    tokens: float, model: ModelShape, link_bps: float = NIC_BPS / GPUS_PER_MACHINE
) -> float:
    """Moving ``tokens`` tokens of KV cache between rollouts on different machines."""
    return tokens * model.kv_bytes_per_token / link_bps
