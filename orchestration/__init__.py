"""Stage DAG, run directories and manifests, local and Ray executors, resume."""
