"""The worker roles: rollout (engine + agent loop + shard node) and trainer (GRPO ranks)."""
