"""A training-like loop that a test kills with SIGKILL at a random point (see test_crash.py).

Every rollout's content is a pure function of its group id, so the parent can check that what a
resumed buffer holds is bit-identical to what was added."""

import sys

import torch

import torchreplay as tr


def rollout_batch(first_id: int, n: int, version: int) -> dict:
    ids = list(range(first_id, first_id + n))
    tokens, logprobs, masks = [], [], []
    for i in ids:
        g = torch.Generator().manual_seed(i)
        length = 8 + i % 300
        tokens.append(torch.randint(0, 50_000, (length,), generator=g))
        logprobs.append(-torch.rand(length, generator=g))
        masks.append(torch.arange(length) >= 4)
    return {"tokens": tokens, "logprobs": logprobs, "response_mask": masks,
            "prompt_len": torch.full((n,), 4), "reward": torch.tensor([float(i % 7) for i in ids]),
            "advantage": torch.tensor([((i * 37) % 11 - 5) / 5.0 for i in ids]),
            "group_id": torch.tensor(ids), "policy_version": version}


def main(uri: str, spill: str, seed: int, mode: str = "latest") -> None:
    """mode "latest": untagged checkpoints every 4 steps; "tags": checkpoint(tag=step) every 2nd
    step, printing "tagged=<step>" once each is durable."""
    buf = tr.RolloutBuffer(
        512, sampler=tr.PrioritizedSampler(alpha=0.8), max_staleness=6, max_reuse=5, seed=seed,
        storage=tr.TieredStorage(hot_bytes=256 << 10, spill_dir=spill, io="posix"),
        checkpoint=tr.Checkpointer(uri, interval_s=0.05, keep_last=2),
    )
    buf.checkpoint()  # an empty first manifest: every kill after "ready" has something to resume
    print("ready", flush=True)
    next_id, step = 0, 0
    while True:
        buf.compose(rollout_batch(next_id, 24, step), replay_ratio=0.5)
        next_id += 24
        buf.sample(16)
        step += 1
        buf.advance(step)
        if mode == "tags" and step % 2 == 0:
            buf.checkpoint(tag=step)
            print(f"tagged={step}", flush=True)
        elif mode == "latest" and step % 4 == 0:
            buf.checkpoint()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
