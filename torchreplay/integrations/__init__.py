"""Adapters for the frameworks RL teams train in: `torchreplay.integrations.trl` (TRL's
GRPOTrainer, with `trl_loss` weighting its KL and entropy terms per row and `trl_vllm` carrying
vLLM's sampling log-probs and IS ratios) and `torchreplay.integrations.verl` (verl's DataProto).
Each imports its framework only when used, so `import torchreplay` never needs either."""
