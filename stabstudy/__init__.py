"""stabstudy: perturbation auditing of training stability."""

__version__ = "0.1.0"
