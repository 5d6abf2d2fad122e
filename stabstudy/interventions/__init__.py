"""What acts on training: perturbation kinds, schedules and their appliers."""
