"""The one place cloudrl reaches into dstack's private modules (`dstack._internal`, dstack 0.22.5).

dstack has no public API for its configuration models, its GPU-vendor defaulting or its resource-name
rule, so `cloudrl validate` (and `cloudrl dashboard`, for the port mapping it asks a run for) uses the
private ones, all imported here and nowhere else. When a dstack release moves one of them,
tests/bundle/test_bundle_mutations.py's `test_dstack_compat_names_resolve` fails naming it, and the command says
which name moved instead of crashing. Imported inside the function: `cloudrl --help` stays fast and
works without dstack.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from .errors import CloudrlError

DSTACK_VERSION = "0.22.5"
# attribute in the namespace below: (module under dstack._internal, its name there)
NAMES = {
    "parse_apply_configuration": ("core.models.configurations", "parse_apply_configuration"),
    "ConfigurationError": ("core.errors", "ConfigurationError"),
    "TaskConfiguration": ("core.models.configurations", "TaskConfiguration"),
    "ServiceConfiguration": ("core.models.configurations", "ServiceConfiguration"),
    "DevEnvironmentConfiguration": ("core.models.configurations", "DevEnvironmentConfiguration"),
    "NodeGroup": ("core.models.configurations", "NodeGroup"),
    "PortMapping": ("core.models.configurations", "PortMapping"),
    "FleetConfiguration": ("core.models.fleets", "FleetConfiguration"),
    "SSHParams": ("core.models.fleets", "SSHParams"),
    "SSHHostParams": ("core.models.fleets", "SSHHostParams"),
    "SSHProxyParams": ("core.models.fleets", "SSHProxyParams"),
    "CloudFleetProps": ("core.models.fleets", "BackendFleetConfiguraionProps"),
    "SSHFleetProps": ("core.models.fleets", "SSHFleetConfigurationProps"),
    "ResourcesSpec": ("core.models.resources", "ResourcesSpec"),
    "GPUSpec": ("core.models.resources", "GPUSpec"),
    "Memory": ("core.models.resources", "Memory"),
    # The server's own rules, run here instead of re-implemented.
    "is_valid_resource_name": ("core.services", "is_valid_dstack_resource_name"),
    "set_default_gpu_spec_vendor": ("server.services.resources", "set_default_gpu_spec_vendor"),
}


def dstack_api(otherwise: str = " (`cloudrl validate` runs dstack's own configuration parser)") -> SimpleNamespace:
    """Every name of NAMES, resolved; a CloudrlError naming the first one that is missing. `otherwise`
    ends the message when dstack is not installed at all (the caller's alternative, or why it is needed)."""
    try:
        importlib.import_module("dstack")
    except ImportError:
        raise CloudrlError(f"dstack is not installed: pip install 'cloudrl[dstack]'{otherwise}") from None
    found = {}
    for attr, (module, name) in NAMES.items():
        try:
            found[attr] = getattr(importlib.import_module(f"dstack._internal.{module}"), name)
        except (ImportError, AttributeError):
            raise CloudrlError(_moved(module, name)) from None
    return SimpleNamespace(**found)


def _moved(module: str, name: str) -> str:
    return (
        f"dstack._internal.{module}.{name} is missing from the installed dstack: cloudrl is written "
        f"for dstack {DSTACK_VERSION}; pip install 'dstack=={DSTACK_VERSION}'"
    )
