"""Dataset recipes (the `datasets` library), shipped small data and trajectory generators."""
