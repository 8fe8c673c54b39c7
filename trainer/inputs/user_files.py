"""A user's Python file named in the config (`reward.function=path/to/file.py:fn`,
`rollout.environment=path/to/env.py:Class`), loaded as a module; and the environment class it names."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from ..errors import DataError


def load_user_file(location: str, what: str, key: str, spec: str):
    """The file at `location` as a module, or a DataError of one line naming the fix (`what`: "reward",
    "environment"; `key`=`spec` the setting that named it).

    Each file gets a module name of its own (its stem and a hash of its path), registered in sys.modules so
    that the module behaves like an imported one (dataclasses and pickling look it up there), and loaded once
    per process. The file's own directory comes first on sys.path while it runs, as for `python file.py`, so a
    helper module beside it imports (`from helpers import x`), and stays at the end for imports made later,
    inside calls."""
    path = Path(location)
    if not path.is_absolute():
        path = Path.cwd() / path
    if path.suffix != ".py":
        raise DataError(f"{what} file {location!r} must be a .py file: fix {key}={spec!r}")
    if not path.is_file():
        raise DataError(f"{what} file not found: {path} (relative paths start at {Path.cwd()}): fix {key}={spec!r}")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
    mod_name = f"cloudrl_{what}_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        del sys.modules[mod_name]
        raise DataError(_missing_module(location, what, exc)) from exc
    except Exception as exc:
        del sys.modules[mod_name]
        raise DataError(f"loading {what} file {path} failed ({type(exc).__name__}: {exc}): fix the file") from exc
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def _missing_module(location: str, what: str, exc: ModuleNotFoundError) -> str:
    """The one line for a file that imports a module this process cannot find: the file as the user wrote it
    (not the copy's path on a node) and the fixes (ship your code, or install the package)."""
    return (
        f"{what} file {location} imports {exc.name or 'a module'!r}, which is neither beside it nor installed "
        f"({type(exc).__name__}: {exc}): with `cloudrl submit`, ship your code with --workdir . (from the "
        f"directory that holds it) or install the package with --pip NAME"
    )


def load_environment(spec: str, key: str = "rollout.environment") -> type:
    """`path/to/env.py:Class` or `module:Class` -> the class, or a DataError of one line naming the fix."""
    spec = spec.strip()
    location, _, name = spec.rpartition(":")
    if not location or not name.isidentifier():
        raise DataError(
            f"{key}={spec!r} is not FILE.py:CLASS or MODULE:CLASS: write it like envs/my_env.py:MyEnv or my_envs:MyEnv"
        )
    if location.endswith(".py") or "/" in location or "\\" in location:
        module = load_user_file(location, "environment", key, spec)  # as reward files are loaded
    else:
        try:
            module = importlib.import_module(location)
        except Exception as exc:
            raise DataError(
                f"importing environment module {location!r} failed ({type(exc).__name__}: {exc}): install it, "
                f"add its folder to PYTHONPATH or give a file path ({key}=path/to/env.py:{name})"
            ) from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        defined = sorted(k for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_"))
        close = difflib.get_close_matches(name, defined, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise DataError(
            f"{location} has no class {name!r}{hint}: it defines {', '.join(defined) or 'no classes'}; fix {key}={spec!r}"
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise DataError(f"{location}:{name} has no {' or '.join(missing)} method: an environment defines both ({key})")
    return cls
