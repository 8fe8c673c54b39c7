"""Prompt datasets: verl-style JSONL/Parquet files, Hugging Face datasets and the built-in arithmetic task
(its problems come from demo.py).

    records = load_prompts("data/train.parquet,hf:openai/gsm8k:main@train", tokenizer, data_cfg=cfg.data, seed=1)
    loader = PromptLoader(records, batch_size=16, shuffle=True, seed=1)
    batch = loader.next_batch()            # list[PromptRecord]; loader.state_dict() goes in checkpoints

A row has the columns verl users already have: `prompt` (a string or a list of chat messages),
`reward_model: {ground_truth: ...}` (or a flat `ground_truth` / `answer` column) and `data_source`;
`data.prompt_key` / `data.answer_key` name other columns, `data.prompt_template` wraps the prompt.
Every other column travels along in `PromptRecord.extra` and reaches the reward function. File rows
and dataset rows (`hub_data.py`) go through the same `_rows_to_records`. Nothing here imports Ray;
pyarrow is imported only when a Parquet file is read, `datasets` only for an `hf:` entry, torch (demo.py)
only for the built-in task.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import DataConfig
from ..errors import DataError, first_line
from .hub_data import HF_PREFIX, check_hub, check_local, load_rows, parse_ref

# Names the reward call passes itself; a file column with one of these names stays out of `extra`.
RESERVED_COLUMNS = ("completions", "prompts", "ground_truth", "data_source")


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    """Token ids the policy is prompted with (chat template applied, left-truncated)."""
    prompt_text: str
    """The text those ids encode: what the model sees."""
    ground_truth: str
    """Reference answer for the reward function; "" when the dataset has none."""
    data_source: str
    """Which dataset the row came from; `auto` rewards dispatch on it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (JSON-able), passed to the reward function as keyword lists."""


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def load_prompts(
    files: str,
    tokenizer,
    *,
    prompt_key: str | None = None,
    max_prompt_length: int | None = None,
    split: str = "train",
    data_cfg: DataConfig | None = None,
    seed: int = 0,
) -> list[PromptRecord]:
    """Read comma-separated `files` (`.jsonl`, `.parquet`, `hf:DATASET[:CONFIG][@SPLIT]` or
    `builtin:arithmetic`) into records.

    `prompt_key` and `max_prompt_length` default to `data_cfg`'s values (or "prompt" and 64);
    `data_cfg` also gives the answer column, the prompt template and the built-in task's size.
    `split` picks the built-in task's fixed evaluation set ("val") and an `hf:` entry's default
    split (train, or test for "val"), and names the config key in error messages. Relative paths
    are relative to the current directory. Raises DataError with the fix in its message.
    """
    cfg = data_cfg or DataConfig()
    key = "data.val_files" if split == "val" else "data.train_files"
    how = _reading(cfg, key, prompt_key, max_prompt_length)
    entries = [f.strip() for f in files.split(",") if f.strip()]
    if not entries:
        from .demo import BUILTIN_ARITHMETIC

        raise DataError(f"no prompt files given: set {key}=path/to/train.parquet (or {BUILTIN_ARITHMETIC})")
    records: list[PromptRecord] = []
    for entry in entries:
        if entry.startswith("builtin:"):
            _check_builtin(entry, key)
            records += _arithmetic_records(tokenizer, cfg, split, seed, how.max_len)
        elif entry.startswith(HF_PREFIX):
            records += _dataset_records(entry, "test" if split == "val" else "train", tokenizer, how)
        else:
            records += _file_records(Path(entry), tokenizer, how)
    return records


def check_prompt_files(files: str, key: str, data_cfg: DataConfig | None = None) -> None:
    """What can be checked of `files` (a data.*_files value) without reading them, in well under a
    second: data.prompt_template, each entry's kind, that each file and local dataset directory exists,
    that the hub answers for a hub dataset, and a file's prompt column (a Parquet file's columns, a JSONL
    file's first row; `data_cfg` names it). The job runs this before it starts a cluster; `load_prompts`
    reads them later."""
    how = _reading(data_cfg or DataConfig(), key)
    for entry in (f.strip() for f in files.split(",") if f.strip()):
        if entry.startswith("builtin:"):
            _check_builtin(entry, key)
        elif entry.startswith(HF_PREFIX):
            ref = parse_ref(entry[len(HF_PREFIX) :], entry)
            check_local(ref, entry)
            check_hub(ref, entry)
        else:
            _check_file(Path(entry), key)
            _check_first_columns(Path(entry), how)


def _check_builtin(entry: str, key: str) -> None:
    from .demo import BUILTIN_ARITHMETIC

    if entry != BUILTIN_ARITHMETIC:
        raise DataError(f"unknown built-in dataset {entry!r} in {key}: the built-in one is {BUILTIN_ARITHMETIC}")


FIRST_ROW_BYTES = 1024**2
"""How far into a JSONL file the check before the cluster looks for its first row."""


def _check_first_columns(path: Path, how: _Reading) -> None:
    """The prompt column (and data.answer_key's) of a Parquet file's schema, or the prompt column of a JSONL
    file's first row, without reading the whole file: refused as `load_prompts` would refuse it. A file this
    cannot read (not UTF-8, not JSON, a first row past FIRST_ROW_BYTES) is left to `load_prompts`, which
    names the problem exactly."""
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            columns = list(pq.read_schema(path).names)
        except (pa.ArrowException, OSError):
            return
        _check_columns(str(path), columns, how, answer=True)
        return
    try:
        with open(path, "rb") as f:
            head = f.read(FIRST_ROW_BYTES)
            if f.read(1):  # more follows: keep whole lines only
                head = head[: head.rfind(b"\n") + 1]
        text = head.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return
    for lineno, line in enumerate(io.StringIO(text, newline=None), start=1):  # lines as `_read_jsonl` splits them
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return
            if isinstance(row, dict):  # a row without data.answer_key's column reads as "" (no answer)
                _check_columns(f"{path}:{lineno}", list(row), how, answer=False)
            return


def _check_file(path: Path, key: str) -> None:
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise DataError(
            f"{path}: unsupported file type {suffix or '(none)'!r}: use .jsonl or .parquet files "
            f"(or hf:DATASET entries) in {key}"
        )
    if not path.is_file():
        raise DataError(f"data file not found: {path} (relative to {Path.cwd()}): check {key}")


@dataclass(frozen=True)
class _Reading:
    """How rows become records: the columns to read, the prompt template and the key errors name."""

    prompt_key: str
    answer_key: str
    template: str
    max_len: int
    key: str


def _reading(
    cfg: DataConfig, key: str, prompt_key: str | None = None, max_prompt_length: int | None = None
) -> _Reading:
    how = _Reading(
        prompt_key or cfg.prompt_key,
        cfg.answer_key,
        cfg.prompt_template,
        max_prompt_length or cfg.max_prompt_length,
        key,
    )
    if how.template and "{prompt}" not in how.template:
        raise DataError(
            f"data.prompt_template={how.template!r} has no {{prompt}}: mark where the prompt goes, "
            f"e.g. data.prompt_template='{{prompt}} Give the final answer after ####.'"
        )
    return how


def _check_columns(label: str, columns: list[str], how: _Reading, answer: bool = True) -> None:
    """The prompt column (and with `answer`, data.answer_key's) is one of `columns`."""
    keys = ((how.prompt_key, "data.prompt_key"), *(((how.answer_key, "data.answer_key"),) if answer else ()))
    for name, setting in keys:
        if name and name not in columns:
            raise DataError(
                f"{label}: no {name!r} column (it has {', '.join(columns) or 'none'}): set {setting}=<one of them>"
            )


def _file_records(path: Path, tokenizer, how: _Reading) -> list[PromptRecord]:
    _check_file(path, how.key)
    rows = _read_jsonl(path) if path.suffix.lower() == ".jsonl" else _read_parquet(path)
    if not rows:
        raise DataError(f"{path}: the file has no rows: add prompts or remove it from {how.key}")
    return _rows_to_records(str(path), rows, path.stem, tokenizer, how)


def _dataset_records(entry: str, default_split: str, tokenizer, how: _Reading) -> list[PromptRecord]:
    ref = parse_ref(entry[len(HF_PREFIX) :], entry)
    ref = replace(ref, split=ref.split or default_split)
    rows = _plain_rows(load_rows(ref, entry, split_fix=f"pick one with @SPLIT in {how.key}"))
    return _rows_to_records(entry, rows, ref.source_name, tokenizer, how)


def _rows_to_records(
    label: str, rows: list[tuple[str, dict]], default_source: str, tokenizer, how: _Reading
) -> list[PromptRecord]:
    """The one path from rows (`where` in the source, column -> value) to records, for files and datasets."""
    _check_columns(label, list(dict.fromkeys(k for _, row in rows for k in row)), how)
    texts, truths, sources, extras = [], [], [], []
    for where, row in rows:
        texts.append(_prompt_text(row.get(how.prompt_key), tokenizer, f"{label}:{where}", how))
        truths.append(_ground_truth(row, how.answer_key))
        sources.append(str(row.get("data_source") or default_source))
        extras.append({k: v for k, v in row.items() if k != how.prompt_key and k not in RESERVED_COLUMNS})
    # A chat template writes the model's special tokens itself, so don't let the tokenizer add more.
    ids = _encode(tokenizer, texts, add_special_tokens=not _has_chat_template(tokenizer))
    records = []
    for (where, _), text, prompt_ids, truth, source, extra in zip(rows, texts, ids, truths, sources, extras):
        if not prompt_ids:
            raise DataError(f"{label}:{where}: the prompt is empty: fill it in or drop the row")
        prompt_ids, text = _left_truncate(tokenizer, prompt_ids, text, how.max_len)
        records.append(PromptRecord(prompt_ids, text, truth, source, extra))
    return records


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    # Decoded whole, so a bad byte is reported at its offset in the file (a text-mode reader would
    # raise a UnicodeDecodeError traceback with an offset into its own buffer).
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at byte offset {exc.start}): re-save it as "
            f"UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.jsonl` (JSON Lines files are UTF-8)"
        ) from None
    # Lines as a text-mode file splits them (\n, \r\n, \r), never at U+2028 inside a JSON string.
    for lineno, line in enumerate(io.StringIO(text, newline=None), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}): fix or remove the line") from None
        if not isinstance(row, dict):
            raise DataError(
                f'{path}:{lineno}: a line must be a JSON object like {{"prompt": "..."}}, got {type(row).__name__}'
            )
        rows.append((str(lineno), row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        first = first_line(exc, exc.__class__.__name__)
        raise DataError(f"{path}: not a readable Parquet file ({first}): rewrite it with pyarrow or pandas") from None
    return _plain_rows(table.to_pylist())


def _plain_rows(rows: list[dict]) -> list[tuple[str, dict]]:
    # Round-trip through JSON so `extra` holds plain values (dates, decimals and bytes become strings).
    return [(f"row {i}", json.loads(json.dumps(row, default=str))) for i, row in enumerate(rows)]


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _prompt_text(prompt: Any, tokenizer, where: str, how: _Reading) -> str:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise DataError(
            f"{where}: {how.prompt_key!r} must be a string or a list of "
            f'{{"role": ..., "content": ...}} messages; got {_short(prompt)}'
        )
    if how.template:
        # The template wraps what the user asks: the last user message (the only one of a string prompt).
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
        messages[last_user]["content"] = how.template.replace("{prompt}", messages[last_user]["content"])
    if _has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if isinstance(prompt, str):
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _ground_truth(row: dict, answer_key: str = "") -> str:
    if answer_key:
        value = row.get(answer_key)
    elif isinstance(row.get("reward_model"), dict) and row["reward_model"].get("ground_truth") is not None:
        value = row["reward_model"]["ground_truth"]
    elif row.get("ground_truth") is not None:
        value = row["ground_truth"]
    else:
        value = row.get("answer")
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


def _encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def _left_truncate(tokenizer, ids: list[int], text: str, max_len: int) -> tuple[list[int], str]:
    """Keep the last `max_len` tokens: the end of a prompt (the question, the generation prompt) matters most."""
    if len(ids) <= max_len:
        return ids, text
    ids = ids[-max_len:]
    return ids, tokenizer.decode(ids, skip_special_tokens=False)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _arithmetic_records(tokenizer, cfg: DataConfig, split: str, seed: int, max_len: int) -> list[PromptRecord]:
    from .demo import BUILTIN_ARITHMETIC, arithmetic_problems

    pairs = arithmetic_problems(cfg, split, seed)
    if not pairs:
        raise DataError(f"{BUILTIN_ARITHMETIC} has no prompts: set data.arithmetic_size >= 1")
    # The raw prompt even when the tokenizer has a chat template: the task targets base models.
    texts = [f"{a}+{b}=" for a, b in pairs]
    records = []
    for (a, b), text, ids in zip(pairs, texts, _encode(tokenizer, texts, add_special_tokens=True)):
        ids, text = _left_truncate(tokenizer, ids, text, max_len)
        records.append(PromptRecord(ids, text, str(a + b), "arithmetic", {}))
    return records


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


class PromptLoader:
    """Endless prompt batches in a resumable, seeded order.

    Epoch e visits every record once, in a permutation seeded by (seed, e) (or in file order when
    `shuffle` is off). Batches are always `batch_size` long: the last batch of an epoch is filled
    from the start of the next epoch, so a batch may span two epochs and no prompt is dropped.
    `state_dict()` is the position of the next record; a loader restored with it yields exactly
    the batches the uninterrupted one would have.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, shuffle: bool = True, seed: int = 0):
        if not records:
            raise DataError("no prompts to batch: check data.train_files")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            # A string seed is hashed with SHA-512, so the order is the same in every process.
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptRecord]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = self._order[self.index : self.index + self.batch_size - len(batch)]
            batch += [self.records[i] for i in take]
            self.index += len(take)
        return batch

    def peek_batches(self, count: int) -> list[list[PromptRecord]]:
        """The batches the next `count` calls of `next_batch` will return, without moving past them."""
        saved = self.epoch, self.index, self._order
        try:
            return [self.next_batch() for _ in range(count)]
        finally:
            self.epoch, self.index, self._order = saved

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.records):
            raise DataError(
                f"prompt loader state {state} does not fit a dataset of {len(self.records)} prompts: "
                f"resume with the same data.train_files, or start a new run (trainer.resume=never)"
            )
        self.epoch, self.index = epoch, index
        self._order = self._epoch_order(epoch)
