"""Analyses that read Datasets only: events, statistics, and one module per notebook in ``studies/``."""
