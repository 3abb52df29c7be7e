"""Adapters for the frameworks RL teams train in: `torchreplay.integrations.trl` (TRL's
GRPOTrainer) and `torchreplay.integrations.verl` (verl's DataProto). Each imports its framework
only when used, so `import torchreplay` never needs either."""
