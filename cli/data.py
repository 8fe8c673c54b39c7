"""`cloudrl data NAME --out DIR`: write a dataset as Parquet files in the trainer's layout.

    cloudrl data gsm8k --out data/gsm8k                      # from the hub (openai/gsm8k, config main)
    cloudrl data gsm8k --out data/gsm8k --source ./gsm8k_saved   # offline: a save_to_disk directory
    cloudrl data arithmetic --out data/arithmetic            # the built-in task, to see the layout

The layout is verl's: `prompt` (chat messages), `reward_model: {ground_truth}`, `data_source`, and the
raw row under `extra_info`. Each dataset is one `Recipe` in RECIPES; add one there to add a name.
Sources are read with the trainer's own `hub_data`, so `--source` takes what an `hf:` entry takes.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import CloudrlError

GSM8K_HUB = "openai/gsm8k:main"
# The instruction the gsm8k reward's strict format needs; trainer/presets/gsm8k-7b.yaml's
# data.prompt_template is the same text (tests/inputs/test_hub_datasets.py keeps them equal).
GSM8K_TEMPLATE = '{prompt} Show your work, then give the final number after "####".'


@dataclass(frozen=True)
class Recipe:
    about: str
    """One line for --help."""
    reward: str
    """The reward.function that scores it."""
    rows: Callable[[str | None, str], list[dict]]
    """(--source or None, split) -> rows in the trainer's layout."""
    splits: tuple[str, ...] = ("train", "test")
    """Splits written, each as SPLIT.parquet."""


@dataclass(frozen=True)
class Written:
    split: str
    rows: int
    path: Path


def write_dataset(name: str, out: str | Path, source: str | None) -> list[Written]:
    """Build every split of dataset `name` (reading `source` if given) and write OUT/SPLIT.parquet."""
    from cloudrl.trainer.errors import DataError

    recipe, out = _recipe(name), Path(out)
    if out.exists() and not out.is_dir():
        raise CloudrlError(f"--out {out} is a file: give a directory for the Parquet files")
    try:
        # Every split is built before anything is written, so a bad source leaves no half dataset.
        tables = {split: recipe.rows(source, split) for split in recipe.splits}
    except DataError as exc:
        raise CloudrlError(str(exc)) from None
    return [_write_parquet(out, split, rows) for split, rows in tables.items()]


def next_command(name: str, written: list[Written]) -> str:
    """The submit command that trains on the written files (the default preset; add --preset for yours)."""
    files = {w.split: w.path for w in written}
    val = f" data.val_files={files['test']}" if "test" in files else ""
    return f"cloudrl submit data.train_files={files['train']}{val} reward.function={_recipe(name).reward}"


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise CloudrlError(f"unknown dataset {name!r}{hint}: cloudrl data writes {', '.join(RECIPES)}")
    return RECIPES[name]


def _write_parquet(out: Path, split: str, rows: list[dict]) -> Written:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    path = (out / f"{split}.parquet").resolve()
    pq.write_table(pa.Table.from_pylist(rows), path)
    return Written(split, len(rows), path)


# ----------------------------------------------------------------------------------------------
# The datasets
# ----------------------------------------------------------------------------------------------


def gsm8k_final_answer(solution: str) -> str | None:
    """GSM8K's answer column ends with `#### 72`: the text after the last `####`, commas dropped."""
    _, marker, rest = solution.rpartition("####")
    answer = rest.strip().replace(",", "")
    return answer if marker and answer else None


def _gsm8k_rows(source: str | None, split: str) -> list[dict]:
    from cloudrl.trainer.inputs.hub_data import load_rows, parse_ref

    label = f"--source {source}" if source else f"hf:{GSM8K_HUB}"
    ref = parse_ref(source or GSM8K_HUB, label)
    if ref.split:
        raise CloudrlError(f"{label}: drop @{ref.split}: cloudrl data writes every split ({split} among them)")
    raw = load_rows(
        replace(ref, split=split),
        label,
        split_fix="point --source at GSM8K (openai/gsm8k, config main), which has train and test",
    )
    if not {"question", "answer"} <= set(raw[0]):
        raise CloudrlError(
            f"{label}: split {split!r} has columns {', '.join(raw[0])}, not GSM8K's question "
            f"and answer: point --source at GSM8K (openai/gsm8k, config main)"
        )
    rows = []
    for index, row in enumerate(raw):
        final = gsm8k_final_answer(str(row["answer"]))
        if final is None:
            raise CloudrlError(
                f"{label}: split {split!r} row {index}: the answer has no `#### <number>` "
                f"line: point --source at GSM8K (openai/gsm8k, config main)"
            )
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": GSM8K_TEMPLATE.replace("{prompt}", row["question"])}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": final},
                "extra_info": {"split": split, "index": index, "question": row["question"], "answer": row["answer"]},
            }
        )
    return rows


def _arithmetic_rows(source: str | None, split: str) -> list[dict]:
    if source:
        raise CloudrlError("the arithmetic task is generated, not read: drop --source")
    from cloudrl.trainer.config import DataConfig
    from cloudrl.trainer.inputs.demo import arithmetic_problems

    # train: the trainer's default draws (seed 0); test: its validation set, every pair once.
    pairs = arithmetic_problems(DataConfig(), "val" if split == "test" else "train", seed=0)
    return [
        {
            "data_source": "arithmetic",
            "prompt": f"{a}+{b}=",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        }
        for a, b in pairs
    ]


RECIPES: dict[str, Recipe] = {
    "gsm8k": Recipe(
        "GSM8K grade-school math (openai/gsm8k, config main): 7473 train and 1319 test problems", "gsm8k", _gsm8k_rows
    ),
    "arithmetic": Recipe(
        "The built-in `a+b=` task (builtin:arithmetic), to see the layout", "arithmetic", _arithmetic_rows
    ),
}
