"""Agents to train with ``rollout.agent`` (see docs/train-your-agent.md)."""
