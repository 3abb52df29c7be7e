"""TRL's GRPOTrainer with torchreplay, on the CPU, with nothing downloaded.

A tiny randomly initialised Qwen2-style causal LM and a character-level tokenizer, both built here
from a transformers config and the `tokenizers` library, learn reasoning-gym's basic_arithmetic
("Calculate 4 - 1.") with reasoning-gym's own answer scoring as the reward. The only changes from a
plain TRL script are the two class names and the replay_* settings.

    python examples/trl_grpo_replay.py --steps 8
"""

from __future__ import annotations

import argparse
import os
import tempfile

from torchreplay.demo.rg_task import QUESTION_CHARS, basic_arithmetic

PAD, EOS, BOS = "_", "$", "^"
SEP = "="  # ends each question: the answer follows


def char_tokenizer():
    """A one-token-per-character tokenizer over the task's characters, as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate([PAD, EOS, BOS, "?", *sorted(set(QUESTION_CHARS + SEP))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS,
                                   unk_token="?", padding_side="left")


def tiny_model(tokenizer, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


def arithmetic_dataset(size: int = 256, seed: int = 0):
    """reasoning-gym's generator; each row keeps its entry so the reward can call its scorer."""
    import json

    from datasets import Dataset

    rg = basic_arithmetic(num_terms=2, size=size, seed=seed)
    rows = [{"prompt": rg[i]["question"] + SEP, "entry": json.dumps(rg[i])} for i in range(size)]
    return Dataset.from_list(rows), rg


def make_reward(rg):
    """1 for an answer reasoning-gym scores correct, else 0 (its own `score_answer`)."""
    import json

    def correct(completions, entry, **_):
        return [float(rg.score_answer(c.split(EOS)[0].strip(), json.loads(e))) for c, e in zip(completions, entry)]

    return correct


def answer_format(completions, **_):
    """A small reward for answering with a number at all: the sparse correctness reward alone gives a
    random tiny model no signal to start from (and its groups no variance to prioritize)."""
    def is_number(text: str) -> bool:
        return text.lstrip("-").isdigit()

    return [0.2 * is_number(c.split(EOS)[0].strip()) for c in completions]


def build_trainer(output_dir: str, steps: int, seed: int = 0, model=None, peft_config=None, **overrides):
    """`model`: a local path (TRL loads a KL reference model from the same path) or None for a
    fresh tiny model; `peft_config`: e.g. a `peft.LoraConfig` to train an adapter."""
    from torchreplay.integrations.trl import ReplayGRPOConfig, ReplayGRPOTrainer

    tokenizer = char_tokenizer()
    dataset, rg = arithmetic_dataset(seed=seed)
    settings = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=seed, temperature=1.0, bf16=False, disable_tqdm=True,
        replay_ratio=0.5, replay_capacity=256, replay_sampler="prioritized", max_staleness=4, max_reuse=4)
    settings.update(overrides)
    args = ReplayGRPOConfig(**settings)
    return ReplayGRPOTrainer(model=model or tiny_model(tokenizer, seed), reward_funcs=[make_reward(rg), answer_format], args=args,
                             train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args.output_dir or tmp, args.steps)
        trainer.train()
        replay = {k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("replay/")}
        for key, value in sorted(replay.items()):
            print(f"{key:28s} {value:.3f}")


if __name__ == "__main__":
    main()
