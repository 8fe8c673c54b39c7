"""Values that must agree between the user's machine and the cluster.

The Ray client that submits jobs must run the same Ray version as the cluster; the bootstrap script
(`tasks/ray-bootstrap.sh`) installs this version on every node and `cloudrl validate` checks it.
"""

RAY_VERSION = "2.60.0"

DASHBOARD_PORT = 8265
"""The Ray dashboard's port on the head node (tasks/ray-bootstrap.sh: CLOUDRL_DASHBOARD_PORT's default),
which `dstack apply` and `cloudrl dashboard` forward to the same port here: the CLI's default address."""
