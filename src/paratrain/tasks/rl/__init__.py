"""Online RL (GRPO, PPO): rollouts, rewards and reward models, their losses, and the prompt records."""
