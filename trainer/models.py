"""Model and tokenizer loading, and the built-in tiny model that needs no download.

Every role loads its model with `from_pretrained` from a directory or hub name. `builtin:tiny` is
materialised once into a local cache directory (a character tokenizer made with `tokenizers` and a
small Llama built from a config, optionally warmed up on the built-in task's answer format), so the
built-in path goes through exactly the same loading code as a real model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import string
from pathlib import Path

import torch

from .errors import ModelLoadError

BUILTIN_PREFIX = "builtin:"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

# Head dim 32 keeps vLLM's CPU attention happy; the rest is as small as learns the built-in task.
TINY_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)


def quiet_transformers() -> None:
    """Keep job logs readable: no per-file progress bars or load reports from every worker."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cache_dir() -> Path:
    return Path(os.environ.get("CLOUDRL_CACHE", Path.home() / ".cache" / "cloudrl"))


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_char_tokenizer():
    """A character-level tokenizer over printable ASCII, built locally with `tokenizers`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   bos_token=None, padding_side="left", model_max_length=256)


def build_tiny_model(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **TINY_CONFIG)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def materialize_builtin(name: str, warmup_steps: int = 0, warmup_lr: float = 3e-3,
                        max_operand: int = 4, seed: int = 0) -> str:
    """Create (once, under a file lock) the built-in model directory and return its path."""
    if name != "tiny":
        raise ModelLoadError(f"unknown built-in model {BUILTIN_PREFIX}{name!r}: the built-in model is builtin:tiny")
    spec = dict(name=name, config=TINY_CONFIG, warmup_steps=warmup_steps, warmup_lr=warmup_lr,
                max_operand=max_operand, seed=seed, version=1)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / f"builtin-{name}-{digest}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tokenizer = build_char_tokenizer()
            model = build_tiny_model(tokenizer, seed)
            if warmup_steps:
                from .data import format_warmup_batches

                _format_warmup(model, tokenizer, format_warmup_batches(tokenizer, max_operand, seed), warmup_steps,
                               warmup_lr)
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
    return str(target)


def _format_warmup(model, tokenizer, batches, steps: int, lr: float) -> None:
    """Supervised steps on (prompt, answer) pairs whose answers are random: the model learns the
    answer format (a number, then end-of-sequence) but nothing about which number is right."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _, (input_ids, attention_mask, labels) in zip(range(steps), batches):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def resolve_path(path: str, cfg=None) -> str:
    """Turn `builtin:*` into its materialised directory; pass other paths through."""
    if not path.startswith(BUILTIN_PREFIX):
        return path
    kwargs = {}
    if cfg is not None:
        kwargs = dict(warmup_steps=cfg.model.sft_warmup_steps, warmup_lr=cfg.model.sft_warmup_lr,
                      max_operand=cfg.data.arithmetic_max_operand, seed=cfg.trainer.seed)
    return materialize_builtin(path[len(BUILTIN_PREFIX):], **kwargs)


def _load(auto_cls, path: str, what: str, **kwargs):
    """`from_pretrained`, or ModelLoadError naming the path, the first line of the reason and the fix.
    Any exception counts: a corrupted weights file raises the safetensors library's own error type."""
    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except Exception as exc:
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__
        if Path(path).is_dir():
            hint = (f"check that {path} holds a complete model (config.json and intact weight files) of an "
                    f"architecture that has this head; model.trust_remote_code=true for custom code")
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
    for name in ("attention_dropout", "hidden_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop", "dropout"):
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    return model


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    return disable_dropout(_load(AutoModelForCausalLM, path, "the policy model", dtype=dtype_of(dtype),
                                 trust_remote_code=trust_remote_code))


def load_value_model(path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """A critic: the causal LM's backbone with a one-output token-classification head."""
    from transformers import AutoModelForTokenClassification

    model, info = _load(AutoModelForTokenClassification, path, "the critic model", num_labels=1,
                        dtype=dtype_of(dtype), trust_remote_code=trust_remote_code, output_loading_info=True)
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

    return _load(AutoModelForSequenceClassification, path, "the reward model", num_labels=1,
                 dtype=dtype_of(dtype), trust_remote_code=trust_remote_code)
