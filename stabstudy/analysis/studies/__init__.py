"""One module per notebook: its grids (RunSpecs) and the tables and claims computed from its runs."""
