"""GRPO with a FSDP2-sharded toy policy and a `DistributedRolloutBuffer`.

Every rank generates rollouts with the current policy, adds them to its own shard, and trains on a
replay batch drawn over all shards (mode "global": exact prioritized sampling over the union, payloads
moved by all_to_all) or from its own shard (mode "local": no payload traffic, IS weights normalized
over all ranks). The loss is the clipped GRPO surrogate, per-token, averaged per rollout and weighted
by the buffer's IS weights.

The task is synthetic: a prompt of two random tokens, a response of `--response-len` tokens, and a
reward equal to the fraction of response tokens that are even. The policy learns it in a few dozen
steps, so the printed mean reward climbs.

CPU (gloo), as in the tests:
    torchrun --nproc_per_node 2 examples/fsdp_grpo.py --steps 20
GPUs (NCCL is chosen automatically when CUDA is available; one process per GPU):
    torchrun --nproc_per_node 8 examples/fsdp_grpo.py --steps 200 --batch-size 64 --mode global
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchreplay as tr
from torchreplay.distributed import DistributedRolloutBuffer


class TinyPolicy(nn.Module):
    """Next-token logits from the current token and its position (a causal bigram MLP).

    Args:
        vocab_size: number of token ids.
        d_model: hidden width.
        max_len: longest sequence, in tokens.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, max_len: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_model), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] int64 -> logits [B, T, vocab] for the token after each position."""
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))[None]
        for block in self.blocks:
            x = x + block(x)
        # A fresh tensor, not a view: FSDP2 hooks the root output for backward and warns on views.
        return self.head(x).clone()


def token_logprobs(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) as [B, T] (0 at position 0, which has no prediction)."""
    logp = F.log_softmax(model(tokens)[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(logp, (1, 0))


@torch.no_grad()
def generate(model: nn.Module, prompts: torch.Tensor, length: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `length` tokens after each prompt. Returns tokens [B, P + length] and their behaviour
    log-probs [B, P + length] (0 on the prompt)."""
    tokens = prompts
    for _ in range(length):
        probs = F.softmax(model(tokens)[:, -1].float(), -1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(tokens.device)
        tokens = torch.cat([tokens, nxt], 1)
    logp = token_logprobs(model, tokens)
    logp[:, : prompts.shape[1]] = 0
    return tokens, logp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=("global", "local"), default="global")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rank per step")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt (GRPO group)")
    parser.add_argument("--batch-size", type=int, default=16, help="replayed rollouts per rank per step")
    parser.add_argument("--response-len", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1 or args.batch_size < 1 or args.group_size < 2 or args.prompts < 1:
        parser.error("--steps, --batch-size, --prompts must be >= 1 and --group-size >= 2")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial weights on every rank before sharding

    model = TinyPolicy(args.vocab, max_len=2 + args.response_len).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    buffer = DistributedRolloutBuffer(
        mode=args.mode, capacity=1024, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.4, eps=0.1),
        max_staleness=4, max_reuse=4,
    )
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # different rollouts per rank
    for step in range(args.steps):
        # -- generate on this rank, add to this rank's shard ----------------------------------------
        n = args.prompts * args.group_size
        prompts = torch.randint(0, args.vocab, (args.prompts, 2), generator=gen).repeat_interleave(args.group_size, 0)
        tokens, logp = generate(model, prompts.to(device), args.response_len, gen)
        tokens, logp = tokens.cpu(), logp.cpu()
        reward = (tokens[:, 2:] % 2 == 0).float().mean(1)
        grouped = reward.view(args.prompts, args.group_size)
        advantage = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        buffer.add({
            "tokens": list(tokens),
            "prompt_len": torch.full((n,), 2),
            "response_mask": list(torch.arange(tokens.shape[1]).expand(n, -1) >= 2),
            "logprobs": list(logp),
            "reward": reward,
            "advantage": advantage,
            "group_id": (step * world + rank) * args.prompts + torch.arange(n) // args.group_size,
            "policy_version": step,
        })

        # -- train on a replay batch ----------------------------------------------------------------
        batch = buffer.sample(args.batch_size, device=device, generator=gen)
        new_logp = token_logprobs(model, batch.tokens)
        ratio = torch.exp(new_logp - batch.logprobs)
        adv = batch.advantage[:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
        mask = batch.response_mask.float()
        per_rollout = (surrogate * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = -(batch.weights * per_rollout).mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        buffer.advance(step + 1)

        stats = torch.tensor([float(loss.detach()), float(reward.mean())], device=device)
        dist.all_reduce(stats)
        stats /= world
        if rank == 0:
            print(f"step {step:4d} loss {stats[0].item():+.4f} reward {stats[1].item():.3f} "
                  f"batch_width {batch.tokens.shape[1]} mean_weight {float(batch.weights.mean()):.3f}", flush=True)

    m = buffer.metrics(global_=True)
    if rank == 0:
        print(f"buffer: size {int(m['size'])} evicted_staleness {int(m['evicted_staleness'])} "
              f"evicted_reuse {int(m['evicted_reuse'])} payload_bytes {int(m['dist_payload_bytes_sent'])}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
