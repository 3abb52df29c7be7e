"""A tiny causal transformer policy, batched sampling with a KV cache, and an SFT warm start."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        # With a cache the new queries sit at the end, so they may see every cached key: no mask needed
        # for the one-token decode steps; a multi-token call without a cache is plain causal.
        causal = past is None and t > 1
        att = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.ff(self.ln2(x))
        return x, (k, v)


class TinyCausalLM(nn.Module):
    """A pre-LayerNorm decoder-only transformer with learned positions (about 100K parameters at defaults).

    Args:
        vocab_size: number of token ids.
        d_model: width; ``n_heads`` must divide it.
        n_layers: number of blocks.
        n_heads: attention heads per block.
        max_len: longest sequence, in tokens.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, max_len: int = 32):
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, 4 * d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, past: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Logits ``[B, T, V]`` for ``tokens [B, T]`` and the updated KV cache.

        With ``past`` the tokens continue the cached sequence (positions offset by the cache length).
        """
        offset = 0 if past is None else past[0][0].shape[2]
        pos = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        cache: KVCache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            cache.append(kv)
        return self.head(self.ln_f(x)), cache

    def num_params(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())


@dataclass
class Rollouts:
    """What :func:`generate` returns; ``T = prompt_len + max_new_tokens``.

    Attributes:
        tokens: ``[B, T]`` int64, prompt then response; after EOS the response holds EOS padding.
        logprobs: ``[B, T]`` float32 behaviour log-probs of each token given its prefix (0 on the prompt).
        response_mask: ``[B, T]`` bool, True on generated tokens up to and including the first EOS.
        lengths: ``[B]`` int64, real length (prompt + generated tokens).
        entropy: mean sampling-distribution entropy over generated tokens, in nats.
        num_generated: generated tokens, the compute unit the demo budgets.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    response_mask: torch.Tensor
    lengths: torch.Tensor
    entropy: float
    num_generated: int


@torch.no_grad()
def generate(
    model: TinyCausalLM,
    prompts: torch.Tensor,
    max_new_tokens: int,
    eos_id: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> Rollouts:
    """Sample (or greedily decode) responses to same-length ``prompts [B, P]``, using a KV cache."""
    was_training = model.training
    model.eval()
    b, p = prompts.shape
    logits, cache = model(prompts)
    logits = logits[:, -1]
    out_tok = [prompts]
    out_lp = [torch.zeros(b, p)]
    out_mask = [torch.zeros(b, p, dtype=torch.bool)]
    done = torch.zeros(b, dtype=torch.bool)
    ent_sum, ent_n = 0.0, 0
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if greedy:
            nxt = logp.argmax(dim=-1)
        else:
            nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        live = ~done
        ent = -(logp.exp() * logp).sum(dim=-1)
        ent_sum += ent[live].sum().item()
        ent_n += int(live.sum())
        nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        out_tok.append(nxt[:, None])
        out_lp.append(torch.where(live, logp.gather(1, nxt[:, None]).squeeze(1), 0.0)[:, None])
        out_mask.append(live[:, None])
        done = done | (nxt == eos_id)
        if bool(done.all()):
            break
        logits, cache = model(nxt[:, None], cache)
        logits = logits[:, -1]
    tokens = torch.cat(out_tok, dim=1)
    mask = torch.cat(out_mask, dim=1)
    # Pad to the full width so callers see a fixed shape whatever step every row stopped at.
    width = p + max_new_tokens
    if tokens.shape[1] < width:
        extra = width - tokens.shape[1]
        tokens = F.pad(tokens, (0, extra), value=eos_id)
        mask = F.pad(mask, (0, extra), value=False)
        out_lp.append(torch.zeros(b, extra))
    model.train(was_training)
    n_gen = int(mask.sum())
    return Rollouts(
        tokens=tokens,
        logprobs=torch.cat(out_lp, dim=1),
        response_mask=mask,
        lengths=p + mask.sum(dim=1),
        entropy=ent_sum / max(ent_n, 1),
        num_generated=n_gen,
    )


def token_logprobs(model: TinyCausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[B, T]`` of each token given its prefix (column 0 is 0) and the entropy ``[B, T]`` there, in nats.

    Right padding is harmless: a causal model never lets padding influence earlier positions.
    """
    logits, _ = model(tokens[:, :-1])
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    lp = logp_all.gather(2, tokens[:, 1:, None]).squeeze(2)
    ent = -(logp_all.exp() * logp_all).sum(dim=-1)
    zeros = torch.zeros(tokens.shape[0], 1)
    return torch.cat([zeros, lp], dim=1), torch.cat([zeros, ent], dim=1)


def sft_warm_start(
    model: TinyCausalLM,
    task: "SortTask",  # noqa: F821 - a duck-typed task with prompts() and target()
    steps: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> list[float]:
    """Supervised steps on ground-truth responses so RL has signal from step 0.

    Returns the per-step cross-entropy losses, in nats per response token.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        prompt, digits = task.prompts(batch_size, generator)
        seq = torch.cat([prompt, task.target(digits)], dim=1)
        logits, _ = model(seq[:, :-1])
        p = prompt.shape[1]
        # Loss only on the response: the prompt is random and unlearnable.
        loss = F.cross_entropy(logits[:, p - 1 :].reshape(-1, logits.shape[-1]), seq[:, p:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
