"""Expected memory per GPU for examples/gpu/config.yaml: computed from the model's shape, not
measured. Prints the table in README.md: ``python examples/gpu/memory.py``.

Trainer rank (FSDP2 over W ranks, bf16 autocast, fp32 master weights, activation checkpointing):

* state: fp32 parameters 4P + fp32 gradients 4P + AdamW's two fp32 moments 8P, all / W;
* gathered: FSDP2 all-gathers one layer's fp32 parameters before its forward and backward and
  prefetches the next; autocast casts each to bf16: 2 units x (4 + 2) bytes x the largest unit
  (one decoder layer, or the embedding / LM head, V x h);
* activations: checkpointing keeps each layer's bf16 input (L x T x h x 2 bytes) and recomputes
  one layer at a time (about T x (16h + 4I) bytes with its gradients, with a fused attention
  kernel); the logits dominate for a large vocabulary: with the trainer's default chunked
  logprobs (laminar/rl/logprobs.py) the bf16 logits and their bf16 gradient, T x V x 4 bytes,
  plus 1 GiB of float32 work per chunk (``logprobs: full`` keeps T x V x 14 bytes: the logits,
  their fp32 copy, the fp32 log-softmax and its gradient);
  T = micro_batch_rows x (prompt + response tokens);
* 1.5 GiB for the CUDA context, NCCL buffers and allocator slack.

Rollout GPU (vLLM, bf16, TP ranks t): vLLM reserves gpu_memory_utilization of the GPU whatever
the model; of it, the weights take 2P / t and the KV cache what is left after ~1 GiB of
activations and CUDA graphs. KV per token: 2 (K, V) x L x kv_heads x head_dim x 2 bytes; the
table gives the KV a full batch (max_num_seqs x max_model_len) would need, against that room.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o; q/k/v biases (Qwen2)
        return attention + 3 * h * self.intermediate + 2 * h  # gate, up, down; two norms

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * self.layer_params + self.hidden


# Qwen2.5 configs (config.json of each Instruct checkpoint)
QWEN25 = [
    Shape("Qwen2.5-0.5B", 151936, 896, 24, 14, 2, 4864, tied=True),
    Shape("Qwen2.5-1.5B", 151936, 1536, 28, 12, 2, 8960, tied=True),
    Shape("Qwen2.5-7B", 152064, 3584, 28, 28, 4, 18944, tied=False),
]


def trainer_bytes(m: Shape, world: int, tokens: int) -> dict[str, float]:
    p = m.params
    unit = max(m.layer_params, m.vocab * m.hidden)
    out = {
        "state": 16 * p / world,
        "gathered": 2 * 6 * unit,
        "activations": m.layers * tokens * m.hidden * 2
        + tokens * (16 * m.hidden + 4 * m.intermediate),
        "logits": tokens * m.vocab * 4 + 1 * GiB,
        "overhead": 1.5 * GiB,
    }
    out["total"] = sum(out.values())
    return out


def rollout_bytes(
    m: Shape, gpu: float, utilization: float, seqs: int, max_len: int, tp: int = 1
) -> dict[str, float]:
    weights = 2 * m.params / tp
    kv_token = 2 * m.layers * max(1, m.kv_heads // tp) * m.head_dim * 2
    return {
        "reserved": utilization * gpu,
        "weights": weights,
        "kv_room": utilization * gpu - weights - 1 * GiB,
        "kv_full_batch": seqs * max_len * kv_token,
    }


def table(world: int = 2, rows: int = 2, seq: int = 1088, gpu: float = 80 * GiB) -> str:
    lines = [
        "| model | params | trainer state | gathered | activations | logits | trainer total "
        "| vLLM weights | KV room (0.85 x 80 GiB) | KV for 128 x 4096 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in QWEN25:
        t = trainer_bytes(m, world, rows * seq)
        r = rollout_bytes(m, gpu, 0.85, 128, 4096)
        g = [f"{v / GiB:.1f}" for v in (t["state"], t["gathered"], t["activations"], t["logits"])]
        lines.append(
            f"| {m.name} | {m.params / 1e9:.2f} B | {' | '.join(g)} | **{t['total'] / GiB:.1f}** "
            f"| {r['weights'] / GiB:.1f} | {r['kv_room'] / GiB:.1f} "
            f"| {r['kv_full_batch'] / GiB:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
