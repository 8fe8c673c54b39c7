"""The Ray side: workers per role, FSDP, placement, the cluster, model staging, launching the roles."""
