"""What a run leaves on disk: checkpoints, sharded role state, bucket copies, the run directory."""
