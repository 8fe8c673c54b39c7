"""What `cloudrl submit` ships: the files a config names, their place in the upload, the limits.

No cluster here: these run in milliseconds. The end-to-end proof (a job from a directory of user
files on a cluster whose nodes have their own disks) is tests/bundle/test_user_job_cluster.py.
"""

from __future__ import annotations

import json
import random
import zipfile
from pathlib import Path

import pytest
import typer.testing
from cloudrl.cli import shipping
from cloudrl.cli.app import app
from cloudrl.cli.errors import CloudrlError
from cloudrl.cli.submit import load_config

runner = typer.testing.CliRunner()
REWARD = "def score(completions, ground_truth, **kw):\n    return [0.125 for _ in completions]\n"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's directory: a reward file, prompts, a preset, and things that must not be shipped."""
    (tmp_path / "my_reward.py").write_text(REWARD)
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}", "ground_truth": "1"}) + "\n" for i in range(8))
    )
    (tmp_path / "my.yaml").write_text("reward:\n  function: my_reward.py:score\ndata:\n  train_files: train.jsonl\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: main\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"\0")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def plan(preset: str, *overrides: str, cwd: Path, **kwargs) -> shipping.Upload:
    return shipping.plan_upload(load_config(preset, list(overrides)), cwd, **kwargs)


def test_files_the_config_names_keep_their_relative_paths(project: Path) -> None:
    upload = plan("my.yaml", cwd=project)
    assert sorted(upload.files) == ["my_reward.py", "train.jsonl"]
    assert upload.rewrites == {}  # already relative to the job's working directory


def test_files_outside_the_current_directory_move_and_the_config_follows(project: Path, tmp_path_factory) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "r.py").write_text(REWARD)
    (elsewhere / "val.jsonl").write_text(json.dumps({"prompt": "v", "ground_truth": "2"}) + "\n")
    upload = plan(
        "my.yaml",
        f"reward.function={elsewhere / 'r.py'}:score",
        f"data.val_files={elsewhere / 'val.jsonl'}",
        cwd=project,
    )
    assert upload.rewrites == {"reward.function": "_external/1/r.py:score", "data.val_files": "_external/2/val.jsonl"}
    assert upload.files["_external/1/r.py"] == (elsewhere / "r.py").resolve()
    # The rewrites go last on the trainer's command line, so they win.
    cfg = load_config("my.yaml", upload.overrides)
    assert cfg.reward.function == "_external/1/r.py:score"


def test_a_relative_path_missing_here_is_one_line(project: Path) -> None:
    with pytest.raises(CloudrlError, match=r"data.train_files: nope.jsonl not found \(relative to .*\): fix the path"):
        plan("my.yaml", "data.train_files=nope.jsonl", cwd=project)
    with pytest.raises(CloudrlError, match="reward.function: gone.py not found"):
        plan("my.yaml", "reward.function=gone.py:score", cwd=project)


def test_an_absolute_path_not_here_is_read_on_the_cluster(project: Path) -> None:
    upload = plan("my.yaml", "data.train_files=/checkpoints/data/train.parquet", cwd=project)
    assert upload.cluster_paths == ["data.train_files: /checkpoints/data/train.parquet"]
    assert "data.train_files" not in upload.rewrites and sorted(upload.files) == ["my_reward.py"]


def test_a_local_model_directory_ships_and_a_hub_id_does_not(project: Path) -> None:
    model = project / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 100)
    upload = plan("my.yaml", "model.path=models/mine", cwd=project)
    assert {"models/mine/config.json", "models/mine/model.safetensors"} <= set(upload.files)
    hub = plan("my.yaml", "model.path=Qwen/Qwen2.5-0.5B-Instruct", cwd=project)
    assert not any(name.startswith("models/") for name in hub.files) and hub.rewrites == {}


def test_a_saved_dataset_directory_ships_and_a_hub_dataset_does_not(project: Path) -> None:
    saved = project / "data" / "saved"
    saved.mkdir(parents=True)
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    upload = plan(
        "my.yaml", "data.val_files=hf:data/saved@train", "data.train_files=hf:openai/gsm8k:main@train", cwd=project
    )
    assert upload.rewrites == {"data.val_files": "hf:./data/saved@train"}
    assert "data/saved/dataset_dict.json" in upload.files
    with pytest.raises(CloudrlError, match="data.val_files: ./gone not found"):
        plan("my.yaml", "data.val_files=hf:./gone@test", cwd=project)


def test_a_module_reward_ships_its_module(project: Path) -> None:
    upload = plan("my.yaml", "reward.function=my_reward:score", cwd=project)
    assert "my_reward.py" in upload.files


def test_workdir_ships_the_tree_minus_ignored_files(project: Path) -> None:
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text("")
    (project / "big.bin").write_bytes(b"\0" * 10)
    (project / "outputs").mkdir()
    (project / "outputs" / "old.log").write_text("x")
    (project / "keep.log").write_text("kept")
    (project / ".cloudrlignore").write_text("# not code\n*.bin\noutputs/\n*.log\n!keep.log\n")
    upload = plan("my.yaml", cwd=project, workdir=project)
    assert set(upload.files) == {
        "my_reward.py",
        "train.jsonl",
        "my.yaml",
        "pkg/__init__.py",
        "keep.log",
        ".cloudrlignore",
    }


@pytest.mark.parametrize(
    "rel, is_dir, expected",
    [
        ("a/b/c.pyc", False, True),
        (".git", True, True),
        ("src/.git", True, True),
        ("data.bin", False, True),
        ("outputs", True, True),
        ("outputs", False, False),
        ("docs/outputs.md", False, False),
        ("top.txt", False, True),
        ("sub/top.txt", False, False),
        ("keep.bin", False, False),
    ],
)
def test_ignore_rules(rel: str, is_dir: bool, expected: bool) -> None:
    patterns = shipping.ALWAYS_IGNORED + ["*.bin", "outputs/", "/top.txt", "!keep.bin"]
    assert shipping.ignored(rel, is_dir, patterns) is expected


def test_the_zip_holds_exactly_the_listed_files(project: Path, tmp_path_factory) -> None:
    upload = plan("my.yaml", cwd=project)
    target = tmp_path_factory.mktemp("zip") / "job.zip"
    size = shipping.write_zip(upload, target)
    assert size == target.stat().st_size
    with zipfile.ZipFile(target) as zf:
        assert sorted(zf.namelist()) == ["my_reward.py", "train.jsonl"]
        assert zf.read("my_reward.py").decode() == REWARD


def test_an_upload_over_the_limit_names_the_big_file(
    project: Path, tmp_path_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_LIMIT_BYTES", 4096)
    (project / "train.jsonl").write_bytes(random.Random(0).randbytes(20_000))  # does not compress
    with pytest.raises(
        CloudrlError,
        match=r"over Ray's .* upload limit \(largest: train.jsonl .*put large files "
        r"on a volume or bucket.*nothing was submitted",
    ):
        shipping.write_zip(plan("my.yaml", cwd=project), tmp_path_factory.mktemp("zip") / "job.zip")


def test_requirements_and_pip_reach_the_runtime_env(project: Path) -> None:
    (project / "requirements.txt").write_text("# deps\nsympy==1.13\n\nregex  # inline\n")
    result = runner.invoke(
        app, ["submit", "--preset", "my.yaml", "--dry-run", "-r", "requirements.txt", "--pip", "math-verify"]
    )
    assert result.exit_code == 0, result.output
    assert "pip:\n    packages:\n    - sympy==1.13\n    - regex\n    - math-verify\n" in result.stdout


def test_dry_run_lists_every_file_with_its_size(project: Path) -> None:
    result = runner.invoke(app, ["submit", "--preset", "my.yaml", "--dry-run"])
    assert result.exit_code == 0, result.output
    listing = result.stdout.split("# files shipped as the job's working directory\n")[1].split("# job request")[0]
    lines = listing.strip().splitlines()
    assert lines[0].split() == [str(len(REWARD)), "B", "my_reward.py"]
    assert lines[1].endswith("train.jsonl")
    assert "total, 2 file(s);" in lines[2] and "zipped (limit 100.0 MiB)" in lines[2]
    assert "working_dir: <the files below, zipped>" in result.stdout


def test_oversized_or_missing_files_fail_in_one_line_before_any_cluster(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CLOUDRL_DEBUG", raising=False)
    # A dead address: had the command got as far as the cluster, the message would be about that instead.
    dead = ["--address", "http://127.0.0.1:9"]
    missing = runner.invoke(app, ["submit", "--preset", "my.yaml", *dead, "data.train_files=missing.jsonl"])
    assert missing.exit_code == 1
    assert len(missing.stderr.strip().splitlines()) == 1 and "missing.jsonl not found" in missing.stderr
    monkeypatch.setattr(shipping, "UPLOAD_LIMIT_BYTES", 1024)
    (project / "train.jsonl").write_bytes(random.Random(0).randbytes(20_000))
    big = runner.invoke(app, ["submit", "--preset", "my.yaml", *dead])
    assert big.exit_code == 1
    assert len(big.stderr.strip().splitlines()) == 1 and "largest: train.jsonl" in big.stderr
