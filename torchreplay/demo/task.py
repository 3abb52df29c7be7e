"""The demo's task: sort a short digit string, with a verifiable reward.

A prompt is ``D digits`` followed by ``>``; the correct response is the same digits in
ascending order followed by ``.`` (end of sequence). The reward is partial credit: the fraction
of the ``D + 1`` answer positions (digits and EOS) that hold the right token, where nothing after
the first EOS scores. Accuracy is exact match of the whole response.
"""

from __future__ import annotations

import torch

DIGITS = "0123456789"
SEP = ">"
EOS = "."
PAD = "_"
VOCAB = list(DIGITS) + [SEP, EOS, PAD]


class Tokenizer:
    """Character tokenizer over the task's 13-symbol vocabulary."""

    def __init__(self) -> None:
        self.vocab = VOCAB
        self.stoi = {c: i for i, c in enumerate(VOCAB)}
        self.sep_id = self.stoi[SEP]
        self.eos_id = self.stoi[EOS]
        self.pad_id = self.stoi[PAD]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """Text to a 1-D int64 tensor of token ids."""
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        """Token ids to text (no special handling of EOS or padding)."""
        return "".join(self.vocab[i] for i in ids.tolist())


class SortTask:
    """Sort ``num_digits`` random digits; prompts are fixed-length so generation needs no padding.

    Args:
        num_digits: digits per prompt; the response is ``num_digits`` digits plus EOS.
    """

    def __init__(self, num_digits: int = 6) -> None:
        self.num_digits = num_digits
        self.tok = Tokenizer()
        self.prompt_len = num_digits + 1
        self.max_new_tokens = num_digits + 1
        self.eos_id = self.tok.eos_id

    def __len__(self) -> int:
        return len(self.tok)

    def prompts(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``n`` prompts.

        Returns:
            ``(prompt_ids [n, prompt_len] int64, digits [n, num_digits] int64)``; the digits are
            the problem, used by :meth:`reward` and :meth:`target`.
        """
        digits = torch.randint(0, 10, (n, self.num_digits), generator=generator)
        sep = torch.full((n, 1), self.tok.sep_id, dtype=torch.int64)
        return torch.cat([digits, sep], dim=1), digits

    def target(self, digits: torch.Tensor) -> torch.Tensor:
        """Correct responses ``[n, num_digits + 1]``: sorted digits, then EOS."""
        eos = torch.full((digits.shape[0], 1), self.tok.eos_id, dtype=torch.int64)
        return torch.cat([digits.sort(dim=1).values, eos], dim=1)

    def score(self, digits: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Score responses.

        Args:
            digits: ``[n, num_digits]`` problems from :meth:`prompts`.
            response: ``[n, num_digits + 1]`` generated ids; anything after the first EOS is
                padding and ignored.

        Returns:
            ``(reward [n] float32 in [0, 1], exact [n] bool)``.
        """
        target = self.target(digits)
        is_eos = (response == self.tok.eos_id).long()
        # A position after the first EOS was never generated, so it can't score.
        eos_before = (is_eos.cumsum(dim=1) - is_eos) > 0
        hit = (response == target) & ~eos_before
        reward = hit.float().mean(dim=1)
        exact = hit.all(dim=1)
        return reward, exact
