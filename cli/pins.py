"""Versions that must agree between the user's machine and the cluster.

The Ray client that submits jobs must run the same Ray version as the cluster; the bootstrap script
(`tasks/ray-bootstrap.sh`) installs this version on every node and `cloudrl validate` checks it.
"""

RAY_VERSION = "2.60.0"
