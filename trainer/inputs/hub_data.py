"""Prompt rows from Hugging Face datasets: the `hf:` entries of `data.train_files` / `data.val_files`.

    hf:openai/gsm8k:main@train      a hub id, its config `main`, its split `train`
    hf:/data/gsm8k_saved@test       a directory written by Dataset(Dict).save_to_disk
    hf:/data/gsm8k_files@train      a directory of data files (parquet, json, csv) in the hub's layout

The syntax is `hf:DATASET[:CONFIG][@SPLIT]`. DATASET is a local directory when it starts with `/`,
`./`, `../` or `~`, or when a directory of that name exists; otherwise it is a hub id, read with
`datasets.load_dataset` (which also finds it in the local HF cache when HF_HUB_OFFLINE=1). A
missing @SPLIT means `train` in data.train_files and `test` in data.val_files.

Before anything is read from the hub, `hub_unreachable` asks its endpoint once (HF_ENDPOINT, bounded
by PROBE_TIMEOUT_S): a hub that does not answer is one line naming the offline ways at once, instead of
the hub client's five retries (about 25 s) and a message that calls the dataset "not found".

This module only fetches rows as plain dicts; `data.py` turns them into PromptRecords with the same
code as file rows. `datasets` is imported only when an `hf:` entry is read.
"""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError

HF_PREFIX = "hf:"
_PATH_STARTS = ("/", "./", "../", "~")
PROBE_TIMEOUT_S = 5.0
"""How long the hub's endpoint may take to answer one request before it counts as unreachable."""
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


@dataclass(frozen=True)
class DatasetRef:
    name: str
    """A hub id (`owner/name`) or a local directory."""
    config: str | None
    """The dataset's config (hub "subset"), e.g. `main` for openai/gsm8k; None = its default."""
    split: str | None
    """The split to read; None = the caller's default."""

    @property
    def is_local(self) -> bool:
        return self.name.startswith(_PATH_STARTS) or Path(self.name).expanduser().is_dir()

    @property
    def source_name(self) -> str:
        """`data_source` for rows without one: the hub id, or the directory's name (`auto` rewards
        dispatch on it, so `openai/gsm8k` is scored as GSM8K)."""
        return Path(self.name).expanduser().resolve().name if self.is_local else self.name


def parse_ref(text: str, label: str) -> DatasetRef:
    """`DATASET[:CONFIG][@SPLIT]` (without the `hf:` prefix) -> DatasetRef. `label` names the entry in errors."""
    rest, at, split = text.rpartition("@")
    if not at or "/" in split:  # an `@` inside a directory path is not a split
        rest, split = text, None
    name, colon, config = rest.partition(":")
    example = "hf:openai/gsm8k:main@train"
    if not name.strip() or (colon and not config.strip()) or (at and split is not None and not split.strip()):
        raise DataError(f"{label}: not DATASET[:CONFIG][@SPLIT]: write it like {example} or hf:/path/to/saved@train")
    return DatasetRef(name.strip(), config.strip() if colon else None, split.strip() if split else None)


def hub_endpoint() -> str:
    """The hub the Hugging Face libraries talk to (HF_ENDPOINT, as huggingface_hub reads it)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_offline() -> bool:
    """The Hugging Face libraries are told to read only their local cache."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_VARIABLES)


def hub_unreachable(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached (one request, bounded by `timeout_s`), or None when it answers or
    when offline mode is on (then nothing is asked of it). Any HTTP answer, an error status too, counts
    as reachable: the hub's own message is the better one then."""
    if hub_offline():
        return None
    return _probe(hub_endpoint(), timeout_s)


@functools.lru_cache(maxsize=8)
def _probe(endpoint: str, timeout_s: float) -> str | None:
    """hub_unreachable's one request, asked once per endpoint in a process (a run reads several entries)."""
    request = urllib.request.Request(endpoint + "/", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        text = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
        return f"{endpoint}: {text.lower() if isinstance(text, str) else text}"
    return None


def dataset_cached(name: str) -> bool:
    """`datasets` holds a copy of hub dataset `name` in its cache (what HF_HUB_OFFLINE=1 reads)."""
    try:
        import datasets
    except ImportError:
        return False
    return (Path(datasets.config.HF_DATASETS_CACHE) / name.replace("/", "___")).is_dir()


def check_local(ref: DatasetRef, label: str) -> None:
    """A local `ref` names an existing directory (what can be checked without reading it)."""
    if ref.is_local and not Path(ref.name).expanduser().is_dir():
        raise DataError(
            f"{label}: no directory {Path(ref.name).expanduser()}: give a directory written by save_to_disk, "
            f"a directory of data files, or a hub id like openai/gsm8k"
        )


def check_hub(ref: DatasetRef, label: str) -> None:
    """A hub `ref` can be read: the hub answers, or offline mode is on. One line with the offline ways
    otherwise (a local copy, or the HF cache when it holds one)."""
    if ref.is_local:
        return
    reason = hub_unreachable()
    if reason is None:
        return
    cached = " (it holds this one)" if dataset_cached(ref.name) else ""
    raise DataError(
        f"{label}: the Hugging Face hub does not answer ({reason}), so dataset {ref.name!r} cannot be read "
        f"from it: set HF_HUB_OFFLINE=1 to read the HF cache{cached}, or use a copy saved with save_to_disk "
        f"(`cloudrl data NAME --source DIR`, or hf:/path/to/saved in data.train_files)"
    )


def load_rows(ref: DatasetRef, label: str, split_fix: str = "pick one with @SPLIT") -> list[dict]:
    """The rows of `ref.split` as plain dicts (column -> value). Every failure is one-line DataError
    naming `label`; `split_fix` is the advice when the split does not exist."""
    datasets = _import_datasets(label)
    loaded = _load(datasets, ref, label)
    if isinstance(loaded, datasets.DatasetDict):
        if ref.split not in loaded:
            raise DataError(f"{label}: no split {ref.split!r} (it has {', '.join(loaded) or 'none'}): {split_fix}")
        loaded = loaded[ref.split]
    # else: a directory saved from one Dataset has no splits; it is read whole.
    rows = loaded.to_list()
    if not rows:
        raise DataError(f"{label}: split {ref.split!r} has no rows: pick another split or dataset")
    return rows


def _import_datasets(label: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{label}: reading hf: datasets needs the `datasets` package: pip install datasets "
            f"(where the trainer's driver runs)"
        ) from None
    return datasets


def _load(datasets, ref: DatasetRef, label: str):
    """Dataset or DatasetDict for `ref`, by where it lives: save_to_disk directory, data-file directory, hub."""
    check_local(ref, label)
    check_hub(ref, label)
    if ref.is_local:
        path = Path(ref.name).expanduser()
        # save_to_disk writes dataset_dict.json (a DatasetDict) or state.json (one Dataset).
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return _call(lambda: datasets.load_from_disk(str(path)), datasets, ref, label)
        return _call(lambda: datasets.load_dataset(str(path), ref.config), datasets, ref, label)
    return _call(lambda: datasets.load_dataset(ref.name, ref.config), datasets, ref, label)


def _call(load, datasets, ref: DatasetRef, label: str):
    """Run a datasets loader; turn its failures into one line that says what to do."""
    try:
        return load()
    except (ConnectionError, FileNotFoundError) as exc:  # also DatasetNotFoundError, no hub access
        where = (
            "check the path"
            if ref.is_local
            else "check the id (and HF_TOKEN for a gated dataset); without hub access (HF_HUB_OFFLINE=1) "
            "it must be in the HF cache ($HF_HOME/datasets) or saved with save_to_disk and given as hf:/path"
        )
        raise DataError(f"{label}: dataset {ref.name!r} not found ({_one_line(exc)}): {where}") from None
    except (ValueError, OSError, datasets.exceptions.DatasetsError) as exc:
        # Most often an unknown config: datasets' message lists the ones that exist.
        raise DataError(
            f"{label}: datasets could not load {ref.name!r} ({_one_line(exc)}): "
            f"check the :CONFIG part against the configs it lists"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
