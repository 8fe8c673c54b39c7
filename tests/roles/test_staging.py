"""Models on every node (trainer/roles/staging.py): fingerprints, shipping a directory, the hub cache.

The pieces run here in-process and on one real Ray node; tests/bundle/test_user_job_cluster.py runs the
whole thing on two simulated nodes that each have their own disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cloudrl.trainer.errors import ModelLoadError
from cloudrl.trainer.roles import staging


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\1" * (staging.SMALL_FILE_BYTES + 10))
    (model / "tokenizer").mkdir()
    (model / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return model


def test_fingerprint_sees_names_sizes_and_small_files(model_dir: Path, tmp_path: Path) -> None:
    base = staging.fingerprint(model_dir)
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    (copy / ".cache-note").write_text("hidden files are not the model")
    assert staging.fingerprint(copy) == base
    (copy / "config.json").write_text('{"hidden_size": 9}')  # same size, other bytes
    assert staging.fingerprint(copy) != base
    shutil.copytree(model_dir, tmp_path / "bigger")
    with open(tmp_path / "bigger" / "model.safetensors", "ab") as f:
        f.write(b"\1")
    assert staging.fingerprint(tmp_path / "bigger") != base


def test_a_shipped_directory_lands_once_in_the_node_cache(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path / "node-cache"))
    expected = staging.fingerprint(model_dir)
    # A node whose disk lacks the path: nothing found, then the copy is found.
    absent = str(tmp_path / "elsewhere" / "my-model")
    assert staging.check_local(absent, expected) is None
    local = staging.unpack(absent, expected, staging.pack(model_dir))
    assert Path(local).parent == tmp_path / "node-cache" / "models"
    assert staging.fingerprint(local) == expected
    assert staging.check_local(absent, expected) == local
    assert staging.unpack(absent, expected, b"not read again") == local
    # A node where the path holds the same model uses it in place; one holding another model does not.
    assert staging.check_local(str(model_dir), expected) == str(model_dir.resolve())
    assert staging.check_local(str(model_dir), "0" * 16) is None


def test_hub_ids_and_paths_are_told_apart(model_dir: Path) -> None:
    assert staging.is_hub_id("Qwen/Qwen2.5-7B-Instruct") and staging.is_hub_id("gpt2")
    assert not staging.is_hub_id(str(model_dir)) and not staging.is_hub_id("./models/x")
    assert not staging.is_hub_id("a/b/c")


def hub_cache(root: Path, repo: str, files: dict[str, str]) -> Path:
    """The layout huggingface_hub leaves after a download: refs/main -> snapshots/<commit>/."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("0123abcd")
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_a_hub_model_resolves_through_the_node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No hub here: an offline cache hit goes through the same snapshot_download call as a download.
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", {"config.json": "{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    local, seconds = staging.download("org/tiny")
    assert Path(local) == snapshot and seconds >= 0
    with pytest.raises(ModelLoadError) as err:
        staging.download("org/absent")
    message = str(err.value)
    assert "downloading org/absent on node" in message and "--env HF_TOKEN" in message
    assert "\n" not in message


@pytest.mark.ray
def test_stage_models_on_a_real_node(ray_local, model_dir: Path) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    lines: list[str] = []
    staged = staging.stage_models([str(model_dir), str(model_dir)], [node], timeout_s=60, echo=lines.append)
    assert list(staged) == [str(model_dir)]
    assert staged[str(model_dir)].by_node == {node: str(model_dir.resolve())}
    assert lines == [f"model: {model_dir}: present on all 1 node(s)"]
    with pytest.raises(ModelLoadError, match="model directory not found on the driver: ./nowhere"):
        staging.stage_models(["./nowhere"], [node], timeout_s=60)


def test_a_node_the_run_did_not_start_on_gets_the_model_from_its_shipped_copy(
    ray_local, model_dir: Path, tmp_path: Path
) -> None:
    """A worker started later (a replacement engine, an engine rollout.elastic adds) on a node that was not
    staged: with `for_new_nodes` it unpacks the object store's copy into its node's cache, checked by
    fingerprint; without it, one line. Here the driver's own directory is moved away, as a new node lacks it."""
    import ray
    from cloudrl.trainer.roles.staging import NodePaths, for_new_nodes, on_this_node

    bare = NodePaths(str(model_dir), {"another-node": str(model_dir)})
    ready = for_new_nodes(bare)
    assert ready.shipped is not None and ready.fingerprint == staging.fingerprint(model_dir)
    assert for_new_nodes(ready) is ready and for_new_nodes(NodePaths("org/model", {}, hub=True)).shipped is None
    shutil.move(model_dir, tmp_path / "elsewhere")

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"CLOUDRL_CACHE": str(tmp_path / "new-node-cache")}})
    def resolve(path: NodePaths) -> str:
        try:
            return on_this_node(path)
        except ModelLoadError as exc:
            return f"error: {exc}"

    local = ray.get(resolve.remote(ready))
    assert local.startswith(str(tmp_path / "new-node-cache")) and staging.fingerprint(local) == ready.fingerprint
    assert ray.get(resolve.remote(bare)).startswith(f"error: {model_dir} was not staged on node ")
