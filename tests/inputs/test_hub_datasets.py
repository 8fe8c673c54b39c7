"""`hf:` entries in data.train_files and `cloudrl data`, all on local files (no hub access needed).

A tiny GSM8K-like DatasetDict is read three ways: from a save_to_disk directory, from a directory
of Parquet files, and by hub id from an HF cache with HF_HUB_OFFLINE=1 (in a subprocess, because
`datasets` and `huggingface_hub` read those variables when they are imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer.testing
import yaml

datasets = pytest.importorskip("datasets", reason="hf: entries need the `datasets` package (pip install datasets)")

from cloudrl.cli.app import app  # noqa: E402
from cloudrl.cli.data import GSM8K_TEMPLATE, gsm8k_final_answer  # noqa: E402
from cloudrl.trainer.config import PRESET_DIR, DataConfig  # noqa: E402
from cloudrl.trainer.errors import DataError  # noqa: E402
from cloudrl.trainer.inputs.data import load_prompts  # noqa: E402
from cloudrl.trainer.inputs.demo import build_char_tokenizer  # noqa: E402
from cloudrl.trainer.inputs.rewards import gsm8k, score  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
runner = typer.testing.CliRunner()

SPLITS = {
    "train": {
        "question": ["Ann has 3 apples and buys 4 more. How many apples?", "What is 6 times 12?"],
        "answer": ["3 + 4 = <<3+4=7>>7\n#### 7", "6 * 12 = <<6*12=72>>72\n#### 72"],
        "level": [1, 2],
    },
    "test": {
        "question": ["A box holds 1,000 pins; 1 is lost. How many are left?"],
        "answer": ["1000 - 1 = 999\n#### 999"],
        "level": [3],
    },
}
# The raw dataset's mapping, as trainer/presets/gsm8k-7b.yaml sets it.
RAW = DataConfig(prompt_key="question", answer_key="answer", prompt_template=GSM8K_TEMPLATE, max_prompt_length=512)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def make_dict():
    return datasets.DatasetDict({name: datasets.Dataset.from_dict(cols) for name, cols in SPLITS.items()})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A DatasetDict written with save_to_disk."""
    path = tmp_path_factory.mktemp("hf") / "gsm_saved"
    make_dict().save_to_disk(str(path))
    return path


def one_line_error(files: str, tok, cfg: DataConfig = RAW, split: str = "train") -> str:
    with pytest.raises(DataError) as err:
        load_prompts(files, tok, data_cfg=cfg, split=split)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# ----------------------------------------------------------------------------------------------
# hf: entries on local directories
# ----------------------------------------------------------------------------------------------


def test_save_to_disk_dict_loads_and_scores(saved, tok):
    records = load_prompts(f"hf:{saved}@train", tok, data_cfg=RAW)
    assert [r.prompt_text for r in records] == [
        GSM8K_TEMPLATE.replace("{prompt}", q) for q in SPLITS["train"]["question"]
    ]
    assert [r.ground_truth for r in records] == SPLITS["train"]["answer"]  # the whole solution
    assert {r.data_source for r in records} == {"gsm_saved"}  # no data_source column: the directory's name
    assert records[1].extra == {"answer": SPLITS["train"]["answer"][1], "level": 2}
    assert score(gsm8k, ["Six twelves... #### 72", "#### 7"], records[::-1]) == [1.0, 1.0]
    assert score(gsm8k, ["#### 71"], records[1:]) == [0.0]
    # Without @SPLIT: train for data.train_files, test for data.val_files.
    assert load_prompts(f"hf:{saved}", tok, data_cfg=RAW)[0].prompt_text == records[0].prompt_text
    (val,) = load_prompts(f"hf:{saved}", tok, data_cfg=RAW, split="val")
    assert val.ground_truth.endswith("#### 999") and score(gsm8k, ["#### 999"], [val]) == [1.0]


def test_single_dataset_and_data_file_directories(tmp_path, tok):
    make_dict()["test"].save_to_disk(str(tmp_path / "one"))
    (rec,) = load_prompts(f"hf:{tmp_path / 'one'}", tok, data_cfg=RAW)  # one Dataset: read whole
    assert rec.extra["level"] == 3
    files = tmp_path / "files"
    files.mkdir()
    for name, split in make_dict().items():  # the hub's file names, which name the splits
        split.to_parquet(str(files / f"{name}-00000-of-00001.parquet"))
    records = load_prompts(f"hf:{files}@test, hf:{tmp_path / 'one'}", tok, data_cfg=RAW)
    assert [r.ground_truth for r in records] == SPLITS["test"]["answer"] * 2


def test_chat_prompts_template_and_flat_answer_key(tmp_path, tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    datasets.Dataset.from_dict({"messages": [chat], "solution": ["4"]}).save_to_disk(str(tmp_path / "chat"))
    cfg = DataConfig(prompt_key="messages", answer_key="solution", prompt_template="Q: {prompt} A:")
    (rec,) = load_prompts(f"hf:{tmp_path / 'chat'}", tok, data_cfg=cfg)
    assert rec.prompt_text == "system: Be brief.\nuser: Q: 2+2? A:"  # only the last user message is wrapped
    assert rec.ground_truth == "4" and rec.extra == {"solution": "4"}


# ----------------------------------------------------------------------------------------------
# hf: entries by hub id, from an offline HF cache
# ----------------------------------------------------------------------------------------------


def write_hub_cache(cache: Path, repo_id: str, config: str) -> None:
    """Put the tiny dataset where `load_dataset(repo_id, config)` looks offline:
    <cache>/<owner>___<name>/<config>/<version>/<hash>/, as a hub download leaves it."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo_id.split("/")
    files = cache.parent / "parquet"
    files.mkdir(parents=True)
    for split, ds in make_dict().items():
        ds.to_parquet(str(files / f"{split}.parquet"))
    stage = cache.parent / "stage"
    builder = Parquet(
        cache_dir=str(stage),
        dataset_name=name,
        config_name=config,
        config_id=config,
        hash="0123456789abcdef",
        data_files={s: str(files / f"{s}.parquet") for s in SPLITS},
    )
    builder.download_and_prepare()
    cache.mkdir(parents=True)
    (stage / name).rename(cache / f"{owner}___{name}")


OFFLINE_SCRIPT = textwrap.dedent("""
    import json, sys
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.data import load_prompts
    from cloudrl.trainer.errors import DataError
    from cloudrl.trainer.inputs.demo import build_char_tokenizer
    from cloudrl.trainer.inputs.rewards import gsm8k, score
    from cloudrl.cli.data import write_dataset

    tok, data = build_char_tokenizer(), load_config("gsm8k-7b").data
    out = {}
    for name, files, split in [("preset_train", data.train_files, "train"), ("preset_val", data.val_files, "val"),
                               ("no_config", "hf:openai/gsm8k@test", "train"),
                               ("bad_split", "hf:openai/gsm8k:main@validation", "train"),
                               ("bad_config", "hf:openai/gsm8k:socratic", "train"),
                               ("not_found", "hf:nobody/nothing", "train")]:
        try:
            records = load_prompts(files, tok, data_cfg=data, split=split)
            out[name] = [[r.prompt_text, r.ground_truth, r.data_source] for r in records]
            out[name + "_scores"] = score(gsm8k, ["#### " + t.split("####")[-1] for _, t, _ in out[name]], records)
        except DataError as exc:
            out[name] = "DataError: " + str(exc)
    out["cli"] = [[w.split, w.rows] for w in write_dataset("gsm8k", sys.argv[1], None)]
    print(json.dumps(out))
""")


def test_hub_id_from_offline_cache(tmp_path):
    write_hub_cache(tmp_path / "hf" / "datasets", "openai/gsm8k", "main")
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_SCRIPT, str(tmp_path / "out")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # The shipped preset's entries and column mapping read the raw dataset, and the gsm8k reward scores it.
    assert [t for t, _, _ in out["preset_train"]] == [
        GSM8K_TEMPLATE.replace("{prompt}", q) for q in SPLITS["train"]["question"]
    ]
    assert [g for _, g, _ in out["preset_train"]] == SPLITS["train"]["answer"]
    assert {s for _, _, s in out["preset_train"]} == {"openai/gsm8k"}  # so reward.function=auto picks gsm8k
    assert out["preset_train_scores"] == [1.0, 1.0] and out["preset_val_scores"] == [1.0]
    assert len(out["no_config"]) == 1
    for name, want in [
        ("bad_split", "hf:openai/gsm8k:main@validation: no split 'validation' (it has train, test)"),
        ("bad_config", "hf:openai/gsm8k:socratic: datasets could not load 'openai/gsm8k' ("),
        ("not_found", "hf:nobody/nothing: dataset 'nobody/nothing' not found ("),
    ]:
        assert out[name].startswith("DataError: " + want) and "\n" not in out[name]
    assert "saved with save_to_disk" in out["not_found"] and "HF_HUB_OFFLINE" in out["not_found"]
    assert "main" in out["bad_config"]  # datasets lists the cached configs
    # `cloudrl data gsm8k` without --source reads the same hub id.
    assert out["cli"] == [["train", 2], ["test", 1]]


# ----------------------------------------------------------------------------------------------
# Errors: one line each, naming the fix
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, cfg, want",
    [
        (
            "hf:{saved}@validation",
            RAW,
            "no split 'validation' (it has train, test): pick one with @SPLIT in data.train_files",
        ),
        ("hf:{saved}", DataConfig(), "no 'prompt' column (it has question, answer, level): set data.prompt_key="),
        (
            "hf:{saved}",
            DataConfig(prompt_key="question", answer_key="solution"),
            "no 'solution' column (it has question, answer, level): set data.answer_key=<one of them>",
        ),
        ("hf:{saved}/nope", RAW, "no directory {saved}/nope: give a directory written by save_to_disk"),
        ("hf:", RAW, "hf:: not DATASET[:CONFIG][@SPLIT]: write it like hf:openai/gsm8k:main@train"),
        ("hf:openai/gsm8k:", RAW, "not DATASET[:CONFIG][@SPLIT]"),
        ("hf:openai/gsm8k@", RAW, "not DATASET[:CONFIG][@SPLIT]"),
        (
            "hf:{saved}",
            DataConfig(prompt_key="question", prompt_template="Q:"),
            "data.prompt_template='Q:' has no {{prompt}}: mark where the prompt goes",
        ),
    ],
)
def test_errors_are_one_line(saved, tok, entry, cfg, want):
    assert want.format(saved=saved) in one_line_error(entry.format(saved=saved), tok, cfg)


def test_missing_datasets_package(monkeypatch, saved, tok):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    message = one_line_error(f"hf:{saved}", tok)
    assert "needs the `datasets` package: pip install datasets" in message


# ----------------------------------------------------------------------------------------------
# cloudrl data
# ----------------------------------------------------------------------------------------------


def test_cli_gsm8k_from_saved_dir(saved, tmp_path, tok):
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "gsm8k", "--source", str(saved), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"train: 2 rows -> {out / 'train.parquet'}",
        f"test: 1 rows -> {out / 'test.parquet'}",
        f"train on them: cloudrl submit data.train_files={out / 'train.parquet'} "
        f"data.val_files={out / 'test.parquet'} reward.function=gsm8k",
    ]
    records = load_prompts(f"{out / 'train.parquet'}", tok, max_prompt_length=512)
    assert [r.ground_truth for r in records] == ["7", "72"] and {r.data_source for r in records} == {"openai/gsm8k"}
    assert records[0].extra["extra_info"] == {
        "split": "train",
        "index": 0,
        "question": SPLITS["train"]["question"][0],
        "answer": SPLITS["train"]["answer"][0],
    }
    assert score(gsm8k, ["#### 7", "so #### 72"], records) == [1.0, 1.0]
    # With a chat template (an instruct model's), the prepared files and the raw dataset read with the
    # preset's mapping give the model the same prompts.
    chat_tok = build_char_tokenizer()
    chat_tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    prepared = load_prompts(f"{out / 'train.parquet'}", chat_tok, max_prompt_length=512)
    raw = load_prompts(f"hf:{saved}@train", chat_tok, data_cfg=RAW)
    assert [r.prompt_text for r in prepared] == [r.prompt_text for r in raw]
    assert raw[0].prompt_text.startswith("[user]Ann has 3 apples") and raw[0].prompt_text.endswith('"####".[assistant]')
    (test,) = load_prompts(f"{out / 'test.parquet'}", tok, max_prompt_length=512)
    assert test.ground_truth == "999"  # "1,000" in the question, the answer's commas dropped


def test_cli_arithmetic_export(tmp_path, tok):
    result = runner.invoke(app, ["data", "arithmetic", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    train = load_prompts(str(tmp_path / "train.parquet"), tok)
    test = load_prompts(str(tmp_path / "test.parquet"), tok)
    builtin = load_prompts("builtin:arithmetic", tok, split="train")  # the same draws (seed 0)
    assert [(r.prompt_text, r.ground_truth) for r in train] == [(r.prompt_text, r.ground_truth) for r in builtin]
    assert len(test) == 25 and {r.data_source for r in test} == {"arithmetic"}


@pytest.mark.parametrize(
    "args, want",
    [
        (["gsm8k", "--source", "{tmp}/nope"], "error: --source {tmp}/nope: no directory {tmp}/nope: give a directory"),
        (["gsm8k", "--source", "{tmp}/one"], "error: --source {tmp}/one: split 'train' has columns x, not GSM8K's"),
        (["gsm8k", "--source", "{saved}@train"], "error: --source {saved}@train: drop @train: cloudrl data writes"),
        (["arithmetic", "--source", "{saved}"], "error: the arithmetic task is generated, not read: drop --source"),
        (["gsm8", "--source", "{saved}"], "error: unknown dataset 'gsm8' (did you mean gsm8k?): cloudrl data writes"),
    ],
)
def test_cli_bad_source_is_one_line(monkeypatch, saved, tmp_path, args, want):
    monkeypatch.delenv("CLOUDRL_DEBUG", raising=False)
    datasets.Dataset.from_dict({"x": [1]}).save_to_disk(str(tmp_path / "one"))
    args = [a.format(tmp=tmp_path, saved=saved) for a in args]
    result = runner.invoke(app, ["data", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(want.format(tmp=tmp_path, saved=saved)), result.stderr
    assert not (tmp_path / "out").exists()


def test_final_answer_and_preset_template():
    assert gsm8k_final_answer("a\n#### 1,234 ") == "1234"
    assert gsm8k_final_answer("no marker") is None and gsm8k_final_answer("#### ") is None
    # The preset and `cloudrl data gsm8k` ask for the answer in the same words.
    preset = yaml.safe_load((PRESET_DIR / "gsm8k-7b.yaml").read_text())["data"]
    assert preset["prompt_template"] == GSM8K_TEMPLATE
    assert (preset["prompt_key"], preset["answer_key"]) == ("question", "answer")
