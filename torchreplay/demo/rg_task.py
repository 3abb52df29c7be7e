"""A sparse-reward task from reasoning-gym (https://github.com/open-thought/reasoning-gym): short
arithmetic, with reasoning-gym's own generator and its own answer scoring.

Questions come from `reasoning_gym.create_dataset("basic_arithmetic", ...)` ("Calculate 4 - 1.");
the response is the answer's characters and EOS, decoded and passed to the dataset's
`score_answer`. The reward is 1 for a correct answer and 0 otherwise, so most early GRPO groups
have zero variance and a rare success is the whole signal: where |advantage| prioritization should
matter most. Only the tokenization (one token per character, questions left-padded to one length)
is ours; the tiny policy has no subword tokenizer.
"""

from __future__ import annotations

import torch

SEP = ">"
EOS = "$"
PAD = "_"
# Every character basic_arithmetic's simple format writes with +/- and single digits, and every
# answer character; a question with another character is refused (the vocabulary is fixed so that
# checkpoints and seeds stay comparable).
QUESTION_CHARS = " +-.0123456789Calcetu"
DATASET_SIZE = 1_000_000  # indices drawn from it: reasoning-gym derives entry i from (seed, i)


def basic_arithmetic(num_terms: int, size: int, seed: int):
    """reasoning-gym's basic_arithmetic, `num_terms` single-digit terms joined by + and -, in its
    simple format ("Calculate 4 - 1."): the questions QUESTION_CHARS covers."""
    import reasoning_gym

    return reasoning_gym.create_dataset(
        "basic_arithmetic", size=size, seed=seed, min_terms=num_terms, max_terms=num_terms, min_digits=1,
        max_digits=1, operators=("+", "-"), allow_parentheses=False, allow_negation=False, format_style="simple",
        whitespace="single")


class ArithmeticTask:
    """reasoning-gym's basic_arithmetic: `num_terms` single-digit terms joined by + and -.

    Problems are dataset indices (an int64 tensor), so prompts, targets and scoring all go back
    to the same reasoning-gym entry.
    """

    def __init__(self, num_terms: int = 3, seed: int = 0) -> None:
        self.num_terms = num_terms
        self.dataset = basic_arithmetic(num_terms, DATASET_SIZE, seed)
        self.vocab = sorted(set(QUESTION_CHARS)) + [SEP, EOS, PAD]
        self.stoi = {c: i for i, c in enumerate(self.vocab)}
        self.sep_id, self.eos_id, self.pad_id = self.stoi[SEP], self.stoi[EOS], self.stoi[PAD]
        # "Calculate a + b - c.", where reasoning-gym's one-digit terms run up to 10, and answers
        # from -10 * (n - 1) to 10 * n: the widest of each.
        self.question_len = len("Calculate .") + 2 * num_terms + 3 * (num_terms - 1)
        self.answer_len = max(len(str(-10 * (num_terms - 1))), len(str(10 * num_terms)))
        self.prompt_len = self.question_len + 1
        self.max_new_tokens = self.answer_len + 1
        self._cache: dict[int, dict] = {}

    def __len__(self) -> int:
        return len(self.vocab)

    def entry(self, index: int) -> dict:
        if index not in self._cache:
            if len(self._cache) > 200_000:
                self._cache.clear()
            self._cache[index] = self.dataset[index]
        return self._cache[index]

    def encode(self, text: str, width: int, left_pad: bool) -> list[int]:
        unknown = set(text) - set(self.stoi)
        if unknown or len(text) > width:
            raise ValueError(f"reasoning-gym text {text!r} does not fit the task's tokens ({sorted(unknown)}) or "
                             f"width {width}")
        ids = [self.stoi[c] for c in text]
        pad = [self.pad_id] * (width - len(ids))
        return pad + ids if left_pad else ids + pad

    def decode_answer(self, ids: torch.Tensor) -> str:
        """A response's text up to its first EOS (the answer reasoning-gym scores)."""
        text = []
        for i in ids.tolist():
            if i == self.eos_id:
                break
            text.append(self.vocab[i])
        return "".join(text)

    def prompts(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` prompts `[n, prompt_len]` (question left-padded, then SEP) and their dataset indices."""
        indices = torch.randint(0, DATASET_SIZE, (n,), generator=generator)
        rows = [self.encode(self.entry(i)["question"], self.question_len, left_pad=True) + [self.sep_id]
                for i in indices.tolist()]
        return torch.tensor(rows, dtype=torch.int64), indices

    def target(self, indices: torch.Tensor) -> torch.Tensor:
        """Correct responses `[n, max_new_tokens]`: the answer, EOS, then EOS padding."""
        rows = [self.encode(self.entry(i)["answer"] + EOS, self.max_new_tokens, left_pad=False)
                for i in indices.tolist()]
        out = torch.tensor(rows, dtype=torch.int64)
        return torch.where(out == self.pad_id, self.eos_id, out)

    def score(self, indices: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """reasoning-gym's `score_answer` per response: `(reward [n] in {0, 1}, exact [n] bool)`."""
        scores = [float(self.dataset.score_answer(answer=self.decode_answer(row), entry=self.entry(i)))
                  for i, row in zip(indices.tolist(), response)]
        exact = torch.tensor(scores) >= 1.0
        return exact.float(), exact
