"""Model and tokenizer loading.

Every role loads its model with `from_pretrained` from a directory or hub name. `builtin:tiny` is
materialised once into a local cache directory first (demo.py), so the built-in path goes through
exactly the same loading code as a real model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError, first_line
from .demo import BUILTIN_PREFIX, materialize_builtin
from .hub_data import hub_unreachable

_PATH_STARTS = ("/", "./", "../", "~")


def quiet_transformers() -> None:
    """Keep job logs readable: no per-file progress bars or load reports from every worker."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_path(path: str, cfg=None) -> str:
    """Turn `builtin:*` into its materialised directory; pass other paths through."""
    if not path.startswith(BUILTIN_PREFIX):
        return path
    kwargs = {}
    if cfg is not None:
        kwargs = dict(
            warmup_steps=cfg.model.sft_warmup_steps,
            warmup_lr=cfg.model.sft_warmup_lr,
            max_operand=cfg.data.arithmetic_max_operand,
            seed=cfg.trainer.seed,
        )
    return materialize_builtin(path[len(BUILTIN_PREFIX) :], **kwargs)


def builtin_model_line(cfg) -> str:
    """The start-up line of a run on the built-in model: whether it was warmed up on a format before RL
    (`model.sft_warmup_steps`), so a run that learns nothing can be told apart from one that never could; ""
    for any other model."""
    path = cfg.model.path
    if not path.startswith(BUILTIN_PREFIX):
        return ""
    steps = cfg.model.sft_warmup_steps
    if steps:
        return (
            f"model: {path}, warmed up for {steps} steps on the built-in arithmetic task's answer format "
            f"(model.sft_warmup_steps; made once, then cached)"
        )
    return (
        f"model: {path} without a format warm-up (model.sft_warmup_steps=0): its first answers are random "
        f"characters, so RL must find the format alone"
    )


def check_model_path(key: str, path: str) -> None:
    """What can be checked of a model setting without loading it, in well under a second (the job runs
    this before it starts a cluster): `builtin:` names the built-in model; a path (`/...`, `./...`,
    `../...`, `~...`, or an existing entry) is a directory; a hub id is reachable, or already in the HF
    cache. Without this, a missing directory would reach the hub client as a malformed hub id."""
    if path.startswith(BUILTIN_PREFIX):
        if path != f"{BUILTIN_PREFIX}tiny":
            raise ModelLoadError(f"{key}={path}: unknown built-in model: the built-in model is builtin:tiny")
        return
    local = Path(path).expanduser()
    if path.startswith(_PATH_STARTS) or local.exists():
        if local.is_dir():
            return
        what = "is a file, not a model directory" if local.exists() else "does not exist"
        raise ModelLoadError(
            f"{key}={path}: the directory {local.resolve() if not local.is_absolute() else local} {what}: give a "
            f"directory holding config.json and the weights, a hub id like Qwen/Qwen2.5-0.5B-Instruct, or builtin:tiny"
        )
    reason = hub_unreachable()
    if reason is None:
        return
    if _hub_model_cached(path):
        fix = "the HF cache holds it: set HF_HUB_OFFLINE=1 to load it from there"
    else:
        fix = (
            "download it where the hub answers and give its directory, or copy an HF cache that holds it "
            "($HF_HOME) here and set HF_HUB_OFFLINE=1"
        )
    raise ModelLoadError(f"{key}={path}: the Hugging Face hub does not answer ({reason}): {fix}")


def _hub_model_cached(repo_id: str) -> bool:
    """The HF cache holds hub model `repo_id` (its config.json): from_pretrained can load it offline."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # a malformed id: from_pretrained will say so
        return False


def _load(auto_cls, path: str, what: str, **kwargs):
    """`from_pretrained`, or ModelLoadError naming the path, the first line of the reason and the fix.
    Any exception counts: a corrupted weights file raises the safetensors library's own error type."""
    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except Exception as exc:
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {first_line(text)[:300]}" if text else type(exc).__name__
        if Path(path).is_dir():
            hint = (
                f"check that {path} holds a complete model (config.json and intact weight files) of an "
                f"architecture that has this head; model.trust_remote_code=true for custom code"
            )
        else:
            hint = "use a local directory with config.json, a hub name on a machine that can download, or builtin:tiny"
        raise ModelLoadError(f"cannot load {what} from {path!r} ({reason}): {hint}") from exc


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = _load(AutoTokenizer, path, "the tokenizer", trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def disable_dropout(model):
    """RL training runs without dropout: it would make the sampling policy and the trained one
    differ, and a resumed run diverge from an uninterrupted one."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for name in (
        "attention_dropout",
        "hidden_dropout",
        "classifier_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "dropout",
    ):
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    return model


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks (`model.model.layers` for most causal LMs and their value-head
    twins), looked through peft's LoRA wrapper; empty for a model without such a list."""
    if hasattr(type(model), "get_base_model"):  # LoRA: peft's wrapper around the transformers model
        model = model.get_base_model()
    layers = getattr(getattr(model, getattr(model, "base_model_prefix", "model"), model), "layers", None)
    return list(layers) if layers is not None else []


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    return disable_dropout(
        _load(
            AutoModelForCausalLM, path, "the policy model", dtype=dtype_of(dtype), trust_remote_code=trust_remote_code
        )
    )


def load_value_model(path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """A critic: the causal LM's backbone with a one-output token-classification head."""
    from transformers import AutoModelForTokenClassification

    model, info = _load(
        AutoModelForTokenClassification,
        path,
        "the critic model",
        num_labels=1,
        dtype=dtype_of(dtype),
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    # A value head that the checkpoint did not have starts at zero, so early values don't swamp
    # the advantages; a trained value model keeps its head.
    head_name = "score" if hasattr(model, "score") else "classifier"
    head = getattr(model, head_name, None)
    if head is not None and any(k.startswith(head_name) for k in info.get("missing_keys", [])):
        torch.nn.init.zeros_(head.weight)
        if getattr(head, "bias", None) is not None:
            torch.nn.init.zeros_(head.bias)
    return disable_dropout(model)


def load_reward_model(path: str, dtype: str = "float32", trust_remote_code: bool = False):
    from transformers import AutoModelForSequenceClassification

    return _load(
        AutoModelForSequenceClassification,
        path,
        "the reward model",
        num_labels=1,
        dtype=dtype_of(dtype),
        trust_remote_code=trust_remote_code,
    )
