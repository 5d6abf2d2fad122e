"""Running the study: run grids on Dask, the atomic run store, papermill execution, the CLI, profiles."""
