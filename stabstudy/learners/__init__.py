"""Learners: ``run(spec) -> xr.Dataset`` for the toy MLPs, the small GPT and stable-baselines3 agents."""
