"""stable-baselines3 agents on gymnasium tasks, with telemetry and perturbations."""
