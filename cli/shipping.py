"""What `cloudrl submit` ships with the job: the local files the config names, and your own code.

Everything goes in one zip that Ray unpacks on every node of the job as its working directory (the
runtime env's `working_dir`): the driver starts in it and every worker runs in it, so a relative path
in the config means on the cluster what it meant here. The upload's layout:

- a file or directory the config names that lies under the current directory keeps its relative path;
- one outside it goes to `_external/<n>/<name>`, and the config is rewritten to point there;
- `--workdir DIR` puts DIR's whole tree at the top (your package: importable by the driver and workers).

Named by the config: `reward.function=FILE.py:fn` (or `module:fn` where `module.py` / `module/` is here),
`rollout.environment=FILE.py:Class` (or `module:Class`) likewise
with the modules it imports from beside it (`from helpers import x` with helpers.py in the same directory,
or in the current one; each shipped module's own such imports too),
the local entries of `data.train_files` / `data.val_files` (files, or `hf:` directories saved with
`save_to_disk`), and local model directories (`model.path`, `critic.model_path`, `reward.model_path`). A
relative path that does not exist here is an error; an absolute one is taken as a path on the cluster
(a volume) and left alone. The zip must stay under the Ray dashboard's upload limit.

A directory is shipped as git would commit it: inside a git work tree, exactly what `git ls-files
--cached --others --exclude-standard` lists (tracked files, and untracked ones no .gitignore excludes);
elsewhere, what the `.gitignore` files of the directory and of every subdirectory leave, each read
relative to its own directory. Either way, never shipped: `.git`, `__pycache__`, `.venv`, `*.pyc`, the
patterns in `.cloudrlignore`, files that usually hold credentials (`SECRET_PATTERNS`: `.env`, `.aws/`,
`.ssh/`, `*.pem`, ...; a `!pattern` line in `.cloudrlignore` ships one anyway), and symlinks that
point outside the directory (never followed: their target's content would travel). `--dry-run`
lists what was left out and why.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CloudrlError

UPLOAD_LIMIT_BYTES = 100 * 1024**2
"""The Ray dashboard refuses request bodies over 100 MiB, and a job's package is one request."""
ALWAYS_IGNORED = [".git/", "__pycache__/", ".venv/", "venv/", "*.pyc", ".cloudrl/", ".ipynb_checkpoints/"]
SECRET_PATTERNS = [
    ".env",
    ".env.*",
    ".envrc",
    ".aws/",
    ".ssh/",
    ".gnupg/",
    ".huggingface/",
    ".docker/",
    "*.pem",
    "*.key",
    "*.p12",
    "id_rsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "id_dsa*",
    ".netrc",
    ".git-credentials",
    ".pypirc",
]
"""Files that usually hold credentials: left out of every upload unless .cloudrlignore re-includes them."""
IGNORE_FILES = (".gitignore", ".cloudrlignore")
GIT_TIMEOUT_S = 30.0
MODEL_KEYS = ("model.path", "critic.model_path", "reward.model_path")
DATA_KEYS = ("data.train_files", "data.val_files")


@dataclass
class Upload:
    """The files of a job's working directory, and the overrides that point the config at them."""

    files: dict[str, Path] = field(default_factory=dict)
    """Path inside the upload -> file on this machine."""
    rewrites: dict[str, str] = field(default_factory=dict)
    """Config key -> its new value (only keys whose files moved)."""
    cluster_paths: list[str] = field(default_factory=list)
    """`key: path` of absolute paths not on this machine: read on the cluster."""
    pip: list[str] = field(default_factory=list)
    excluded: list[tuple[str, str]] = field(default_factory=list)
    """(path, why) of what a shipped directory holds but the upload leaves out."""

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.rewrites.items()]

    def size(self) -> int:
        return sum(path.stat().st_size for path in self.files.values())

    def listing(self, zipped_bytes: int | None = None) -> str:
        """What --dry-run prints: every file with its size, then the totals."""
        lines = [f"  {_human(src.stat().st_size):>10}  {dest}" for dest, src in sorted(self.files.items())]
        total = f"  {_human(self.size()):>10}  total, {len(self.files)} file(s)"
        if zipped_bytes is not None:
            total += f"; {_human(zipped_bytes)} zipped (limit {_human(UPLOAD_LIMIT_BYTES)})"
        return "\n".join(lines + [total])

    def excluded_listing(self, limit: int = 200) -> str:
        """What --dry-run prints about the files left out: each with the reason."""
        lines = [f"  {path}  ({why})" for path, why in sorted(self.excluded)[:limit]]
        if len(self.excluded) > limit:
            lines.append(f"  ... and {len(self.excluded) - limit} more")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Finding what the config names
# ----------------------------------------------------------------------------------------------


def plan_upload(
    cfg: Any, cwd: Path, workdir: Path | None = None, requirements: Path | None = None, pip: list[str] | None = None
) -> Upload:
    """Every local file `cfg` names (and `workdir`'s tree), where each lands, and the config rewrites."""
    upload = Upload()
    if workdir is not None:
        if not workdir.is_dir():
            raise CloudrlError(f"--workdir {workdir}: not a directory here: give the directory of your own code")
        for dest, src in walk(workdir, upload.excluded).items():
            upload.files[dest] = src
    external = _External(upload, cwd)
    _reward(cfg, cwd, external)
    _reward(cfg, cwd, external, "rollout.environment")
    for key in DATA_KEYS:
        value = _get(cfg, key)
        if value:
            entries = [_data_entry(key, entry.strip(), cwd, external) for entry in value.split(",") if entry.strip()]
            if ",".join(entries) != ",".join(e.strip() for e in value.split(",") if e.strip()):
                upload.rewrites[key] = ",".join(entries)
    for key in MODEL_KEYS:
        value = _get(cfg, key)
        if value and not value.startswith("builtin:"):
            new = _model_entry(key, value, cwd, external)
            if new != value:
                upload.rewrites[key] = new
    upload.pip = read_requirements(requirements) + list(pip or [])
    return upload


class _External:
    """Adds files to the upload: under their cwd-relative path, or under _external/<n>/ if outside cwd."""

    def __init__(self, upload: Upload, cwd: Path):
        self.upload, self.cwd, self.count = upload, cwd.resolve(), 0

    def add(self, path: Path, dest: str | None = None) -> str:
        """Ship `path` (file or directory) at `dest` (default: its cwd-relative path, or a new
        _external/<n>/ directory); returns the path the config should use on the cluster."""
        real = path.resolve()
        if dest is None:
            try:
                dest = real.relative_to(self.cwd).as_posix()
            except ValueError:
                self.count += 1
                dest = f"_external/{self.count}/{real.name}"
        if real.is_dir():
            excluded: list[tuple[str, str]] = []
            for inner, src in walk(real, excluded).items():
                self.upload.files[f"{dest}/{inner}"] = src
            self.upload.excluded += [(f"{dest}/{inner}", why) for inner, why in excluded]
        else:
            self.upload.files[dest] = real
        return dest


def _get(cfg: Any, key: str) -> str:
    section, name = key.split(".")
    return str(getattr(getattr(cfg, section), name) or "")


def _local(key: str, value: str, cwd: Path) -> Path | None:
    """`value` as a path on this machine; None for an absolute path that is not here (a cluster path)."""
    path = Path(value).expanduser()
    full = path if path.is_absolute() else cwd / path
    if full.exists():
        return full
    if path.is_absolute():
        return None
    raise CloudrlError(
        f"{key}: {value} not found (relative to {cwd}): fix the path; a file that exists only on "
        f"the cluster must be given as an absolute path (e.g. /checkpoints/...)"
    )


def _reward(cfg: Any, cwd: Path, external: _External, key: str = "reward.function") -> None:
    """Ship the code `key` names (FILE.py:NAME or module:NAME): reward.function, rollout.environment."""
    spec = _get(cfg, key).strip()
    if ":" not in spec:
        return  # a built-in reward
    location, _, fn = spec.rpartition(":")
    if location.endswith(".py"):
        local = _local(key, location, cwd)
        if local is None:
            external.upload.cluster_paths.append(f"{key}: {location}")
            return
        dest = external.add(local)
        if dest != location:
            external.upload.rewrites[key] = f"{dest}:{fn}"
        _imported_beside(local, dest.rpartition("/")[0], cwd, external)
        return
    # module:fn — ship the top-level module if it is a file or package here; else it is installed.
    top = location.split(".")[0]
    for candidate in (cwd / f"{top}.py", cwd / top):
        if candidate.is_file() or (candidate / "__init__.py").is_file():
            dest = external.add(candidate)
            _imported_beside(candidate, dest.rpartition("/")[0], cwd, external)
            return


def _imported_beside(source: Path, folder: str, cwd: Path, external: _External) -> None:
    """Ship the modules `source` (a .py file or a package directory, shipped into upload folder `folder`)
    imports from beside it, into the same folder, and from the current directory, at the top; then what
    those import, in turn. On the cluster the reward file's directory is on sys.path while it loads (as
    for `python file.py`) and the job's working directory always is, so both import as they do here."""
    seen = {source.resolve()}
    todo = [source]
    while todo:
        path = todo.pop()
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for name in _top_level_imports(file):
                for base, dest_dir in ((source.parent, folder), (cwd, "")):
                    found = _module_at(base, name)
                    if found is None:
                        continue
                    if found.resolve() not in seen:
                        seen.add(found.resolve())
                        dest = f"{dest_dir}/{found.name}" if dest_dir else found.name
                        external.add(found, dest)
                        todo.append(found)
                    break


def _module_at(folder: Path, name: str) -> Path | None:
    """Module `name` as `folder` holds it: name.py, or a package directory name/ with __init__.py."""
    if (folder / f"{name}.py").is_file():
        return folder / f"{name}.py"
    if (folder / name / "__init__.py").is_file():
        return folder / name
    return None


def _top_level_imports(file: Path) -> list[str]:
    """The top-level names of the absolute imports in a Python file (`import a.b`, `from a import b`:
    `a`), anywhere in it; none when the file does not parse (loading it on the cluster will say why)."""
    import ast

    try:
        tree = ast.parse(file.read_text(errors="replace"), str(file))
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return list(dict.fromkeys(names))


def _data_entry(key: str, entry: str, cwd: Path, external: _External) -> str:
    if entry.startswith("builtin:"):
        return entry
    if entry.startswith("hf:"):
        return _dataset_entry(key, entry, cwd, external)
    local = _local(key, entry, cwd)
    if local is None:
        external.upload.cluster_paths.append(f"{key}: {entry}")
        return entry
    return external.add(local)


def _dataset_entry(key: str, entry: str, cwd: Path, external: _External) -> str:
    """An `hf:` entry: a local directory (save_to_disk, or data files) ships; a hub id stays."""
    from cloudrl.trainer.errors import DataError
    from cloudrl.trainer.inputs.hub_data import parse_ref

    try:
        ref = parse_ref(entry[3:], key)
    except DataError as exc:
        raise CloudrlError(str(exc)) from None
    path = Path(ref.name).expanduser()
    full = path if path.is_absolute() else cwd / path
    if not full.is_dir():
        if path.is_absolute():
            external.upload.cluster_paths.append(f"{key}: {entry}")
        elif ref.name.startswith((".", "~")):
            raise CloudrlError(f"{key}: {ref.name} not found (relative to {cwd}): fix the path")
        return entry  # a hub id
    config = f":{ref.config}" if ref.config else ""
    split = f"@{ref.split}" if ref.split else ""
    return f"hf:./{external.add(full)}{config}{split}"


def _model_entry(key: str, value: str, cwd: Path, external: _External) -> str:
    path = Path(value).expanduser()
    full = path if path.is_absolute() else cwd / path
    if full.is_dir():
        return external.add(full)
    if path.is_absolute() or value.startswith((".", "~")):
        if not path.is_absolute():
            raise CloudrlError(f"{key}: {value} not found (relative to {cwd}): fix the path")
        external.upload.cluster_paths.append(f"{key}: {value}")
    return value  # a hub id, or a path on the cluster


def read_requirements(path: Path | None) -> list[str]:
    """The requirement lines of a requirements file (comments and blank lines dropped)."""
    if path is None:
        return []
    if not path.is_file():
        raise CloudrlError(f"--requirements {path}: no such file here: give a requirements.txt path")
    lines = [line.split("#", 1)[0].strip() for line in path.read_text(errors="replace").splitlines()]
    for line in lines:
        if line.startswith(("-r", "-c", "--requirement", "--constraint")):
            raise CloudrlError(
                f"--requirements {path}: nested requirement files ({line!r}) are not shipped: "
                f"list the packages in this file"
            )
    return [line for line in lines if line]


# ----------------------------------------------------------------------------------------------
# Ignore rules and walking a directory
# ----------------------------------------------------------------------------------------------


Rule = tuple[str, str, str]
"""(pattern, where it comes from, the directory it is relative to: '' or 'sub/dir/')."""


def ignore_patterns(root: Path) -> list[str]:
    """The patterns that apply at the top of `root` (built-in ones first, then its ignore files)."""
    return [pattern for pattern, _, _ in _root_rules(root, IGNORE_FILES)]


def _root_rules(root: Path, files: tuple[str, ...]) -> list[Rule]:
    rules: list[Rule] = [(p, "always left out", "") for p in ALWAYS_IGNORED]
    rules += [(p, "may hold credentials; `!PATTERN` in .cloudrlignore ships it", "") for p in SECRET_PATTERNS]
    for name in files:
        rules += _file_rules(root / name, "")
    return rules


def _file_rules(file: Path, base: str) -> list[Rule]:
    if not file.is_file():
        return []
    where = f"{base}{file.name}"
    return [
        (line.strip(), where, base)
        for line in file.read_text(errors="replace").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _why_ignored(rel: str, is_dir: bool, rules: list[Rule]) -> str | None:
    """Why `rel` is left out (the last matching rule wins, as in gitignore), or None if it is kept."""
    why = None
    for pattern, origin, base in rules:
        if not rel.startswith(base):
            continue
        if ignored(rel[len(base) :], is_dir, [pattern]) or (
            pattern.startswith("!") and ignored(rel[len(base) :], is_dir, [pattern[1:]])
        ):
            why = None if pattern.startswith("!") else f"{pattern} ({origin})"
    return why


def ignored(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    """gitignore-style: `name` matches at any depth, `/x` only at the top, `dir/` only directories,
    `!pattern` re-includes; the last matching pattern wins."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern[1:] if negate else pattern
        if pattern.endswith("/"):
            if not is_dir:
                continue
            pattern = pattern.rstrip("/")
        anchored = "/" in pattern
        pattern = pattern.lstrip("/")
        if anchored:
            hit = fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(rel, pattern.replace("**/", ""))
        else:
            hit = fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], pattern)
        if hit:
            result = not negate
    return result


def walk(root: Path, excluded: list[tuple[str, str]] | None = None) -> dict[str, Path]:
    """Relative path -> file, for every file under root that is shipped (see the module docstring);
    what is left out is appended to `excluded` as (relative path, why)."""
    out = excluded if excluded is not None else []
    listed = _git_listing(root)
    if listed is None:
        return _walk_tree(root, out)
    tracked, git_ignored = listed
    out += [(rel, "ignored by git (.gitignore)") for rel in git_ignored]
    rules = _root_rules(root, (".cloudrlignore",))
    real_root = root.resolve()
    files: dict[str, Path] = {}
    for rel in sorted(tracked):
        parts = rel.split("/")
        why = next(
            (w for i in range(1, len(parts)) if (w := _why_ignored("/".join(parts[:i]), True, rules))),
            None,
        ) or _why_ignored(rel, False, rules)
        path = root / rel
        why = why or _link_outside(path, real_root)
        if why:
            out.append((rel, why))
        elif path.is_file():
            files[rel] = path
        elif path.is_dir():
            out.append((rel, "a directory git lists as one entry (a submodule or a link): not shipped"))
    return files


def _walk_tree(root: Path, out: list[tuple[str, str]]) -> dict[str, Path]:
    """walk() outside git: every directory's own .gitignore and .cloudrlignore apply below it."""
    real_root = root.resolve()
    rules = _root_rules(root, IGNORE_FILES)
    files: dict[str, Path] = {}
    for current, dirs, names in os.walk(root, followlinks=False):
        base = Path(current).relative_to(root).as_posix()
        prefix = "" if base == "." else base + "/"
        if prefix:
            for name in IGNORE_FILES:
                rules += _file_rules(Path(current) / name, prefix)
        kept_dirs = []
        for d in sorted(dirs):
            why = _why_ignored(prefix + d, True, rules) or _link_outside(Path(current) / d, real_root)
            if why:
                out.append((prefix + d + "/", why))
            elif (Path(current) / d).is_symlink():
                out.append((prefix + d + "/", "a symlink to a directory: not followed"))
            else:
                kept_dirs.append(d)
        dirs[:] = kept_dirs
        for name in sorted(names):
            rel = prefix + name
            path = Path(current) / name
            why = _why_ignored(rel, False, rules) or _link_outside(path, real_root)
            if why:
                out.append((rel, why))
            elif path.is_file():
                files[rel] = path
    return files


def _link_outside(path: Path, real_root: Path) -> str | None:
    """Why a symlink is not followed: it points outside the shipped directory (or nowhere)."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if not target.is_relative_to(real_root):
        return f"a symlink to {target}, outside the directory: not followed"
    return None


def _git_listing(root: Path) -> tuple[list[str], list[str]] | None:
    """(files git would commit, untracked paths its ignore rules exclude) under root, relative to it;
    None when root is not in a git work tree (or git is not installed)."""

    def git(*args: str) -> list[str] | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, timeout=GIT_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        return [p for p in done.stdout.decode(errors="surrogateescape").split("\0") if p]

    inside = git("rev-parse", "--is-inside-work-tree")
    if not inside or inside[0].strip() != "true":
        return None
    tracked = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    ignored_paths = git("ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    if tracked is None:
        return None
    return sorted(set(tracked)), ignored_paths or []


# ----------------------------------------------------------------------------------------------
# The zip
# ----------------------------------------------------------------------------------------------


def write_zip(upload: Upload, target: Path) -> int:
    """Write the upload as a zip at `target`; returns its size, or raises if over the limit."""
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for dest, src in sorted(upload.files.items()):
            zf.write(src, dest)
    size = target.stat().st_size
    if size >= UPLOAD_LIMIT_BYTES:
        biggest = sorted(upload.files.items(), key=lambda item: -item[1].stat().st_size)[:3]
        names = ", ".join(f"{dest} ({_human(src.stat().st_size)})" for dest, src in biggest)
        raise CloudrlError(
            f"the job's files are {_human(size)} zipped, over Ray's {_human(UPLOAD_LIMIT_BYTES)} upload limit "
            f"(largest: {names}): put large files on a volume or bucket the cluster mounts and give their "
            f"absolute path, or list them in .cloudrlignore; nothing was submitted"
        )
    return size


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
