"""The memory plan of a run: what each GPU of each role holds, and its peak, before anything starts.

Pure arithmetic over the config and the model's shape (`ModelShape`, read from its config.json): no Ray, no
CUDA, no weights. `plan_memory(cfg, shape)` returns one `GpuPlan` per kind of GPU (the actor's, the critic's,
the reference's, the reward model's, an engine's), each a list of `Line`s with the phases of a step in which
they are resident; the peak is the largest phase. `check_fits` refuses what exceeds a GPU's memory in one
line naming the keys that would make it fit (each tried on a copy of the config). `cloudrl plan` prints it.

Notation: P parameters of the model (counted from its shape: embeddings, every block's projections, norms
and biases, the output head unless tied), h hidden size, i MLP width, L layers, V vocabulary, d the bytes of
model.dtype (2 for bfloat16/float16, 4 for float32), N the role's ranks (its world size), S = N when the
role shards with FSDP (`<role>.fsdp=true` on GPUs), else 1. GiB = 2^30 bytes.

Trained roles (actor, critic), per GPU (TrainableWorker: fp32 master weights, compute in model.dtype):
- parameters: 4·P / S (fp32 masters). Under `<role>.cpu_offload` they live on the host, as do the
  gradients and the optimizer state (FSDP2's CPUOffloadPolicy).
- gradients: 4·T / S, T the trained parameters (P, or under LoRA the adapters'); freed after each
  optimizer step (zero_grad(set_to_none=True)), so absent while the engines generate.
- AdamW state: 8·T / S (two fp32 moments), from the first step on.
- optimizer step: + 4·T / S while it runs: sharded, torch's foreach AdamW computes sqrt(v) out of place;
  unsharded over N > 1 ranks, the flat buffer of the gradient all-reduce (the fused AdamW needs none).
- compute copy: sharded, FSDP2 gathers the root's parameters (embeddings, head) and, prefetching, two
  blocks at a time in model.dtype: d·(P_root + 2·P_block); unsharded under autocast, d·P (the cast cache).
- LoRA (`model.lora_rank > 0`, the actor): the frozen base is held in model.dtype (d·P / S, no gradients or
  state; inputs/lora.freeze_base); the adapters add r·(in + out) fp32 parameters per targeted linear layer (T =
  their sum, 4·T / S). Unsharded, autocast then casts only the adapters: a compute copy of d·T.
- reference in the actor's processes (`placement.colocate_actor_ref`, or `colocate_all`): d·P / S, sharded
  like the policy; under LoRA none (the adapters are switched off instead).
- activations of one micro-batch of M tokens: M = `<role>.max_tokens_per_micro_batch` when set (at least one
  whole sequence), else micro_batch_size x (data.max_prompt_length + response budget), the response budget
  being rollout.max_new_tokens (rollout.max_episode_tokens in multi-turn runs).
  Padded rows are full width at the peak; `model.pack_sequences` lowers the mean, not this bound. Per token
  and layer d·(12·h + m·i) bytes, m = 4 for a gated MLP (gate, up, act(gate), their product), 2 otherwise:
  the tensors autograd keeps for a bf16 Qwen2/Llama block under sdpa (counted with saved-tensor hooks),
  rounded. With `model.gradient_checkpointing`: d·h per token and layer (each block's input) plus one
  block's full set. Plus d·4·h per token outside the blocks (embeddings, final norm).
- logits (actor): the log-prob/entropy step (ppo_math.token_stats_from_logits) keeps only the logits in
  model.dtype, for R + 1 positions per row (logits_to_keep), and their gradient of the same size:
  2·d·rows·(R + 1)·V, plus its float32 chunk temporaries, 3·4·min(1024, positions)·V.

Frozen and generating roles, per GPU:
- reference workers of their own: d·P whole (not sharded), one block's activations and the logits of
  reference.micro_batch_size rows plus one float32 chunk.
- vLLM/SGLang engines: rollout.gpu_memory_utilization x the GPU's memory; in it the weights, d·P / (tp·pp),
  and the KV cache, the rest, holding rest / (2·(L/pp)·max(1, kv_heads/tp)·head_dim·d) tokens (before the
  engine's own activation and CUDA-graph reserve, so at most that). Under `placement.colocate_all` the engines
  share the actor's GPUs and sleep (weights and KV cache freed) while the roles train: their budget counts
  in the generation phase only, beside what the trainers keep resident (parameters, optimizer state, the
  reference, the critic's).
- HF engines: d·P and, while generating, the KV cache of their share of the rollout batch at full length.
- a reward model (reward.model_path): d·P_reward on the GPUs it runs on.
- every worker process on a GPU (a trained role, a reference or reward worker, an HF engine, and under
  `placement.colocate_all` each role and the sleeping engine that share the GPU): its CUDA context, the
  caching allocator's first block and an NCCL communicator, PROCESS_GIB = 1.15 GiB, measured on an H200 with
  torch 2.11 and NCCL 2.28 (bench/gpu_overheads.py: 523 + 94 + 558 MiB). vLLM and SGLang engines on GPUs of
  their own count theirs inside rollout.gpu_memory_utilization.

The measured check: bench/README.md's "GPU smoke" (one H200, a 98.6M and a 1.1B random Qwen2) in
tests/loop/test_memory_plan.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, ConfigError
from .errors import ModelLoadError, first_line

GIB = float(1 << 30)
LOGIT_CHUNK = 1024
"""Positions per chunk of ppo_math.token_stats_from_logits."""

RESIDENT = "*"

PROCESS_GIB = (523 + 94 + 558) / 1024
"""A GPU process before its own tensors: CUDA context, the allocator's first block, an NCCL communicator (MiB
measured on an H200 by bench/gpu_overheads.py)."""
"""A line's phase when it stays on the GPU through every phase of a step."""
GENERATE = "generation"

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_NON_GATED = ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class DoesNotFit(ConfigError):
    """A role's GPUs cannot hold what the config asks of them."""


# ----------------------------------------------------------------------------------------------
# The model's shape
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a dense decoder's config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    gated: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    name: str = ""

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of one block's linear layers: what `all-linear` LoRA adapts."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        attn = [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h)]
        mlp = [("up_proj", h, i), ("down_proj", i, h)]
        return attn + ([("gate_proj", h, i)] if self.gated else []) + mlp

    @property
    def block_params(self) -> int:
        p = sum(a * b for _, a, b in self.linears())
        p += (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        p += 2 * self.head_dim if self.qk_norm else 0
        return p + 2 * self.hidden  # two norms

    def root_params(self, head: str = "lm") -> int:
        """Outside the blocks: embeddings, final norm, and the head (tied: none; value: h x 1)."""
        embed = self.vocab * self.hidden
        out = {"lm": 0 if self.tied else embed, "value": self.hidden + 1}[head]
        return embed + self.hidden + out

    def params(self, head: str = "lm") -> int:
        return self.layers * self.block_params + self.root_params(head)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: r·(in + out) per targeted linear layer of every block."""
        names = {n for n, _, _ in self.linears()} if targets == ["all-linear"] else set(targets)
        return self.layers * sum(rank * (a + b) for n, a, b in self.linears() if n in names)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1, pp: int = 1) -> float:
        """KV cache per token on one GPU of an engine split tp x pp ways (kv heads are replicated below tp)."""
        layers = math.ceil(self.layers / pp)
        return 2 * layers * max(1.0, self.kv_heads / tp) * self.head_dim * dtype_bytes

    def activation_bytes(self, dtype_bytes: int, checkpointing: bool) -> tuple[float, float]:
        """(per token per layer kept for the backward, one block's full set per token); see the docstring."""
        full = dtype_bytes * (12 * self.hidden + (4 if self.gated else 2) * self.intermediate)
        return (dtype_bytes * self.hidden, full) if checkpointing else (full, 0.0)


def shape_from_config(config: Any) -> ModelShape:
    """A ModelShape from a transformers config (or anything with its attributes)."""

    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            value = getattr(config, n, None)
            if value is not None:
                return value
        return default

    model_type = str(get("model_type", default=""))
    if any(get(k) for k in _EXPERT_KEYS):
        raise ModelLoadError(
            f"the memory plan covers dense models; {model_type or 'this model'} routes tokens to experts, "
            f"whose memory it does not estimate"
        )
    hidden = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    vocab = get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, vocab)):
        raise ModelLoadError(
            f"the model config ({model_type or 'unknown type'}) lacks hidden_size, num_hidden_layers, "
            f"num_attention_heads or vocab_size: the memory plan needs a decoder's config.json"
        )
    gated = model_type not in _NON_GATED
    bias = get("attention_bias", default=model_type == "qwen2")
    return ModelShape(
        hidden=hidden,
        intermediate=get("intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden,
        layers=layers,
        heads=heads,
        kv_heads=get("num_key_value_heads", default=heads) or heads,
        head_dim=get("head_dim", default=None) or hidden // heads,
        vocab=vocab,
        tied=bool(get("tie_word_embeddings", default=False)),
        gated=gated,
        qkv_bias=bool(bias),
        qk_norm=model_type.startswith("qwen3"),
        name=model_type,
    )


def read_shape(path: str, key: str = "model.path", trust_remote_code: bool = False) -> ModelShape:
    """The shape of the model at `path`: a local directory, `builtin:tiny`, or a hub id (from the HF cache,
    else from the hub when it answers). Only config.json is read."""
    from transformers import AutoConfig

    from .inputs.models import check_model_path, resolve_path

    fix = (
        f"give {key} a local directory holding the model's config.json (the weights are not needed), or run "
        f"where the hub answers or the HF cache holds it"
    )
    source = path
    try:
        check_model_path(key, path)
        source = resolve_path(path)
        if not Path(source).expanduser().is_dir():
            cached = _cached_config(path)
            source = str(Path(cached).parent) if cached else path
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ModelLoadError as exc:
        raise ModelLoadError(f"cannot read the model config for the memory plan: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read the model config of {key}={path} ({type(exc).__name__}: {first_line(exc)[:200]}): {fix}"
        ) from None
    return shape_from_config(config)


def _cached_config(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed id: AutoConfig will say so
        return None
    return found if isinstance(found, str) else None


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------


@dataclass
class Line:
    what: str
    gib: float
    phases: tuple[str, ...]
    """The phases of a step in which it is resident on the GPU; empty: on the host."""


@dataclass
class GpuPlan:
    """One kind of GPU: every GPU of a role (or an engine) holds the same."""

    role: str
    gpus: int
    keys: str
    """The config keys behind these GPUs, for messages."""
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_gpu: bool = True
    """False for CPU workers: the lines are host memory and no GPU limit applies."""
    extra_misfit: str = ""
    """Why it cannot work whatever the peak (an engine whose KV cache holds no whole sequence)."""

    def phase_totals(self) -> dict[str, float]:
        """GiB on the GPU in each phase: its own lines and the resident ones."""
        phases = sorted({p for line in self.lines for p in line.phases if p != RESIDENT}) or ["resident"]
        resident = sum(line.gib for line in self.lines if RESIDENT in line.phases)
        return {p: resident + sum(line.gib for line in self.lines if p in line.phases) for p in phases}

    @property
    def peak(self) -> tuple[str, float]:
        totals = self.phase_totals()
        if not totals:
            return "", 0.0
        phase = max(totals, key=lambda p: totals[p])
        return phase, totals[phase]

    @property
    def host_gib(self) -> float:
        return sum(line.gib for line in self.lines if not line.phases)


@dataclass
class MemoryPlan:
    gpus: list[GpuPlan]
    assumptions: list[str]

    def misfits(self, gpu_gib: float) -> list[GpuPlan]:
        return [g for g in self.gpus if g.on_gpu and (g.peak[1] > gpu_gib or g.extra_misfit)]


@dataclass
class _Trained:
    """A trained role's parameter state per rank, in GiB."""

    params: float
    grads: float
    optim: float
    step_temp: float
    compute_copy: float
    sharded: bool
    offload: bool
    what: str


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


def _bytes(cfg: Config) -> int:
    return _DTYPE_BYTES[cfg.model.dtype]


def _sharded(cfg: Config, role: str) -> bool:
    rc = getattr(cfg, role)
    return rc.fsdp and (rc.world_size > 1 or rc.gpus_per_node > 0)


def _trained(cfg: Config, role: str, shape: ModelShape) -> _Trained:
    rc = getattr(cfg, role)
    d = _bytes(cfg)
    head = "value" if role == "critic" else "lm"
    total = shape.params(head)
    lora = role == "actor" and cfg.model.lora_rank > 0
    trained = shape.lora_params(cfg.model.lora_rank, list(cfg.model.lora_target_modules)) if lora else total
    sharded = _sharded(cfg, role)
    s = rc.world_size if sharded else 1
    if sharded:
        copy_params = shape.root_params(head) + 2 * shape.block_params
    else:  # autocast casts what is not in model.dtype already: under LoRA the adapters alone
        copy_params = (trained if lora else total) if d < 4 else 0
    what = _count(total) + (f" frozen in {cfg.model.dtype} + {_count(trained)} LoRA" if lora else "")
    return _Trained(
        params=(d * total + 4 * trained if lora else 4 * total) / s / GIB,
        grads=4 * trained / s / GIB,
        optim=8 * trained / s / GIB,
        step_temp=4 * trained / s / GIB if sharded or rc.world_size > 1 else 0.0,
        compute_copy=d * copy_params / GIB,
        sharded=sharded,
        offload=sharded and rc.cpu_offload,
        what=what,
    )


def _lengths(cfg: Config) -> tuple[int, int]:
    """(prompt, response) budgets in tokens."""
    return cfg.data.max_prompt_length, cfg.response_limit


def _micro(cfg: Config, role: str) -> tuple[float, float, str]:
    """(tokens, rows) of one micro-batch at the peak, and how that was reached."""
    rc = getattr(cfg, role)
    p, r = _lengths(cfg)
    width = p + r
    if rc.max_tokens_per_micro_batch > 0:
        tokens = max(rc.max_tokens_per_micro_batch, width)
        return tokens, tokens / width, f"{role}.max_tokens_per_micro_batch={rc.max_tokens_per_micro_batch}"
    return rc.micro_batch_size * width, rc.micro_batch_size, f"{role}.micro_batch_size={rc.micro_batch_size}"


def _activations(cfg: Config, role: str, shape: ModelShape) -> tuple[float, str]:
    tokens, _, how = _micro(cfg, role)
    d = _bytes(cfg)
    kept, block = shape.activation_bytes(d, cfg.model.gradient_checkpointing)
    total = tokens * (shape.layers * kept + block + 4 * d * shape.hidden)
    ckpt = ", checkpointed" if cfg.model.gradient_checkpointing else ""
    return total / GIB, f"activations ({int(tokens)} tokens: {how}{ckpt})"


def _logits(cfg: Config, rows: float, shape: ModelShape, grad: bool) -> float:
    _, r = _lengths(cfg)
    positions = rows * (r + 1)
    held = (2 if grad else 1) * _bytes(cfg) * positions * shape.vocab
    chunks = (3 if grad else 1) * 4 * min(LOGIT_CHUNK, positions) * shape.vocab
    return (held + chunks) / GIB


def _trained_lines(cfg: Config, role: str, shape: ModelShape) -> list[Line]:
    """A trained role's lines: resident state, and what its update ("<role> update") and optimizer step
    ("<role> step") add."""
    rc = getattr(cfg, role)
    t = _trained(cfg, role, shape)
    update, step = f"{role} update", f"{role} step"
    where = " (on the host: cpu_offload)" if t.offload else ""
    shard = f", 1/{rc.world_size} each (FSDP)" if t.sharded and rc.world_size > 1 else ""

    def on_gpu(*phases: str) -> tuple[str, ...]:
        return () if t.offload else phases

    lines = [
        Line(f"{role} parameters, fp32 masters ({t.what}{shard}){where}", t.params, on_gpu(RESIDENT)),
        Line(f"{role} gradients, fp32{where}", t.grads, on_gpu(update, step)),
        Line(f"{role} AdamW state, 2 x fp32{where}", t.optim, on_gpu(RESIDENT)),
    ]
    if t.step_temp:
        kind = "foreach AdamW" if t.sharded else "gradient all-reduce buffer"
        lines.append(Line(f"{role} optimizer step temporary ({kind}){where}", t.step_temp, on_gpu(step)))
    if t.compute_copy:
        kind = "FSDP-gathered root and blocks" if t.sharded else "autocast copy"
        lines.append(Line(f"{role} compute copy in {cfg.model.dtype} ({kind})", t.compute_copy, (update,)))
    acts, what = _activations(cfg, role, shape)
    lines.append(Line(f"{role} {what}", acts, (update,)))
    if role == "actor":
        _, rows, _ = _micro(cfg, role)
        logits = _logits(cfg, rows, shape, grad=True)
        lines.append(Line("actor logits and their gradient (chunked log-probs)", logits, (update,)))
    return lines


def _engine_lines(cfg: Config, shape: ModelShape, gpu_gib: float) -> tuple[list[Line], str, str]:
    """vLLM/SGLang, while generating: (lines, a note with the KV cache tokens, a misfit reason or "")."""
    r = cfg.rollout
    d = _bytes(cfg)
    budget = r.gpu_memory_utilization * gpu_gib
    weights = d * shape.params() / r.ranks_per_engine / GIB
    kv = max(budget - weights, 0.0)
    per_token = shape.kv_bytes_per_token(d, r.tensor_parallel_size, r.pipeline_parallel_size)
    tokens = int(kv * GIB / per_token)
    p, resp = _lengths(cfg)
    split = f", 1/{r.ranks_per_engine}: tp x pp" if r.ranks_per_engine > 1 else ""
    lines = [
        Line(f"{r.engine} weights in {cfg.model.dtype}{split}", weights, (GENERATE,)),
        Line(f"{r.engine} KV cache (the rest of gpu_memory_utilization={r.gpu_memory_utilization:g})", kv, (GENERATE,)),
    ]
    note = (
        f"KV cache: {tokens:,} tokens per engine GPU ({per_token / 1024:.1f} KiB per token), "
        f"{tokens // (p + resp):,} sequences of {p + resp} tokens at once"
    )
    misfit = ""
    if weights >= budget:
        misfit = (
            f"the {r.engine} weights need {weights:.1f} GiB per GPU but rollout.gpu_memory_utilization="
            f"{r.gpu_memory_utilization:g} of {gpu_gib:g} GiB gives {budget:.1f} GiB"
        )
    elif tokens < p + resp:
        misfit = f"the {r.engine} KV cache holds {tokens} tokens per GPU, less than one sequence ({p + resp})"
    return lines, note, misfit


def _kv_line(cfg: Config, shape: ModelShape, sequences: int) -> Line:
    p, resp = _lengths(cfg)
    kv = sequences * (p + resp) * shape.kv_bytes_per_token(_bytes(cfg)) / GIB
    return Line(f"generation KV cache ({sequences} sequences x {p + resp} tokens)", kv, (GENERATE,))


def _hf_engine_lines(cfg: Config, shape: ModelShape) -> list[Line]:
    sequences = math.ceil(cfg.rollout_batch_size / max(cfg.rollout.num_engines, 1))
    weights = _bytes(cfg) * shape.params() / GIB
    return [Line(f"HF engine weights in {cfg.model.dtype}", weights, (RESIDENT,)), _kv_line(cfg, shape, sequences)]


def _reference_line(cfg: Config, shape: ModelShape, shards: int) -> Line:
    each = f", 1/{shards} each" if shards > 1 else ""
    gib = _bytes(cfg) * shape.params() / shards / GIB
    return Line(f"reference in {cfg.model.dtype} ({_count(shape.params())}{each})", gib, (RESIDENT,))


def _reward_line(cfg: Config, reward: ModelShape | None) -> list[Line]:
    if not cfg.reward.model_path or reward is None:
        return []
    return [Line(f"reward model in {cfg.model.dtype}", _bytes(cfg) * reward.params("value") / GIB, (RESIDENT,))]


def _processes_line(count: int) -> Line:
    what = f"CUDA context, allocator and NCCL of {count} process{'es' if count > 1 else ''}"
    return Line(what, count * PROCESS_GIB, (RESIDENT,))


def _role_plan(cfg: Config, role: str, keys: str) -> GpuPlan:
    rc = getattr(cfg, role)
    return GpuPlan(role, rc.world_size, keys, on_gpu=rc.gpus_per_node > 0)


def plan_memory(
    cfg: Config,
    shape: ModelShape,
    gpu_gib: float = 80.0,
    critic_shape: ModelShape | None = None,
    reward_shape: ModelShape | None = None,
) -> MemoryPlan:
    """Per GPU of every role and engine: what it holds in each phase of a step. `critic_shape` and
    `reward_shape`: critic.model_path's and reward.model_path's (default: the policy's; none)."""
    from .roles.placement import reference_in_actor

    p, r = cfg.placement, cfg.rollout
    critic_shape = critic_shape or shape
    gpu_engine = r.engine in ("vllm", "sglang")
    plans: list[GpuPlan] = []

    # The actor's GPUs, and under colocate_all whatever shares them.
    a = cfg.actor
    actor = _role_plan(cfg, "actor", f"actor.nodes={a.nodes} x actor.gpus_per_node={a.gpus_per_node}")
    actor.lines += _trained_lines(cfg, "actor", shape)
    if reference_in_actor(cfg) and cfg.model.lora_rank == 0:
        actor.lines.append(_reference_line(cfg, shape, a.world_size if _sharded(cfg, "actor") else 1))
    if p.rollout_in_actor:
        actor.lines.append(_kv_line(cfg, shape, math.ceil(cfg.rollout_batch_size / max(a.world_size, 1))))
    if p.colocate_all:
        if cfg.uses_critic:
            actor.lines += _trained_lines(cfg, "critic", critic_shape)
        if not p.rollout_in_actor and gpu_engine:
            lines, note, actor.extra_misfit = _engine_lines(cfg, shape, gpu_gib)
            actor.lines += [Line(f"{x.what}, asleep while the roles train", x.gib, x.phases) for x in lines]
            actor.notes.append(note)
        elif not p.rollout_in_actor:
            actor.lines += _hf_engine_lines(cfg, shape)
        actor.lines += _reward_line(cfg, reward_shape) if cfg.uses_reward_workers else []
    processes = 1
    if p.colocate_all:
        processes += int(cfg.uses_critic) + int(not p.rollout_in_actor)
        processes += int(cfg.uses_reward_workers and bool(_reward_line(cfg, reward_shape)))
    actor.lines.append(_processes_line(processes))
    plans.append(actor)
    if p.colocate_all:
        return MemoryPlan(plans, _assumptions(cfg))

    if cfg.uses_reference and not reference_in_actor(cfg):
        ref = _role_plan(cfg, "reference", "reference.nodes x reference.gpus_per_node")
        ref.lines.append(_reference_line(cfg, shape, 1))
        tokens, rows, how = _micro(cfg, "reference")
        _, block = shape.activation_bytes(_bytes(cfg), checkpointing=False)
        phase = ("reference log-probs",)
        ref.lines.append(Line(f"one block's activations ({int(tokens)} tokens: {how})", tokens * block / GIB, phase))
        ref.lines.append(Line("logits (chunked log-probs, no gradient)", _logits(cfg, rows, shape, False), phase))
        ref.lines.append(_processes_line(1))
        plans.append(ref)
    if cfg.uses_critic:
        c = cfg.critic
        critic = _role_plan(cfg, "critic", f"critic.nodes={c.nodes} x critic.gpus_per_node={c.gpus_per_node}")
        critic.lines += _trained_lines(cfg, "critic", critic_shape)
        shared = p.colocate_critic_reward and cfg.uses_reward_workers and bool(_reward_line(cfg, reward_shape))
        if shared:
            critic.lines += _reward_line(cfg, reward_shape)
        critic.lines.append(_processes_line(1 + int(shared)))
        plans.append(critic)
    reward_alone = cfg.uses_reward_workers and not (cfg.uses_critic and p.colocate_critic_reward)
    if reward_alone and cfg.reward.gpus_per_node and _reward_line(cfg, reward_shape):
        reward = _role_plan(cfg, "reward", "reward.nodes x reward.gpus_per_node")
        reward.lines += _reward_line(cfg, reward_shape)
        reward.lines.append(_processes_line(1))
        plans.append(reward)
    if not p.rollout_in_actor:
        if gpu_engine and (r.gpus_per_engine > 0 or r.ranks_per_engine > 1 or a.gpus_per_node > 0):
            keys = "rollout.tensor_parallel_size x rollout.pipeline_parallel_size"
            engine = GpuPlan(f"rollout ({r.engine})", r.num_engines * r.ranks_per_engine, keys)
            engine.lines, note, engine.extra_misfit = _engine_lines(cfg, shape, gpu_gib)
            engine.notes.append(note)
            plans.append(engine)
        elif r.engine == "hf" and r.gpus_per_engine > 0:
            engine = GpuPlan("rollout (hf)", math.ceil(r.num_engines * r.gpus_per_engine), "rollout.gpus_per_engine")
            engine.lines += _hf_engine_lines(cfg, shape)
            engine.lines.append(_processes_line(1))
            plans.append(engine)
    return MemoryPlan(plans, _assumptions(cfg))


def _assumptions(cfg: Config) -> list[str]:
    p, r = _lengths(cfg)
    out = [
        f"sequences at full length: data.max_prompt_length={p} + a {r}-token response budget",
        "activations: d*(12h + 4i) bytes per token and layer (gated MLP), d*h with gradient checkpointing",
    ]
    if cfg.model.pack_sequences:
        out.append("model.pack_sequences lowers the mean tokens per micro-batch, not the peak bound used here")
    return out


# ----------------------------------------------------------------------------------------------
# Printing and refusing
# ----------------------------------------------------------------------------------------------


def plan_text(plan: MemoryPlan, gpu_gib: float) -> str:
    """The plan as a table per kind of GPU: each line's GiB, the phase totals and the peak."""
    out: list[str] = []
    for g in plan.gpus:
        where = f"per GPU, {g.gpus} GPU(s)" if g.on_gpu else "per CPU worker (host memory)"
        out.append(f"{g.role} ({where})")
        width = max([len(line.what) for line in g.lines] + [10])
        for line in g.lines:
            place = ", ".join(line.phases).replace(RESIDENT, "resident") if line.phases else "host"
            out.append(f"  {line.what:<{width}}  {line.gib:9.2f} GiB   {place}")
        totals = g.phase_totals()
        if totals:
            out.append("  " + "; ".join(f"{phase}: {gib:.2f} GiB" for phase, gib in totals.items()))
        phase, peak = g.peak
        if g.host_gib:
            out.append(f"  on the host per rank: {g.host_gib:.2f} GiB")
        if g.on_gpu:
            verdict = "fits" if peak <= gpu_gib and not g.extra_misfit else "DOES NOT FIT"
            out.append(f"  peak {peak:.2f} GiB ({phase}) of {gpu_gib:g} GiB: {verdict}")
        out += [f"  {note}" for note in g.notes]
        out.append("")
    out += [f"assumes {a}" for a in plan.assumptions]
    return "\n".join(out) + "\n"


def _candidates(cfg: Config, role: str) -> list[tuple[str, dict[str, Any]]]:
    """Single changes that lower `role`'s memory: (the key=value to name, the changes to apply)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if role.startswith("rollout") or (role == "actor" and cfg.placement.colocate_all and cfg.rollout.engine != "hf"):
        r = cfg.rollout
        tp = r.tensor_parallel_size * 2
        out.append((f"rollout.tensor_parallel_size={tp}", {"rollout.tensor_parallel_size": tp}))
        if role.startswith("rollout"):
            out.append(("rollout.gpu_memory_utilization=0.95", {"rollout.gpu_memory_utilization": 0.95}))
        else:
            util = round(r.gpu_memory_utilization * 0.6, 2)
            out.append((f"rollout.gpu_memory_utilization={util:g}", {"rollout.gpu_memory_utilization": util}))
    for trained in [x for x in ("actor", "critic") if role == x or (role == "actor" and cfg.placement.colocate_all)]:
        rc = getattr(cfg, trained)
        if trained == "critic" and not cfg.uses_critic:
            continue
        if not rc.fsdp:
            out.append((f"{trained}.fsdp=true", {f"{trained}.fsdp": True}))
        for factor in (2, 4, 8):
            out.append((f"{trained}.nodes={rc.nodes * factor}", {f"{trained}.nodes": rc.nodes * factor}))
        if not rc.cpu_offload:
            name = f"{trained}.cpu_offload=true" if rc.fsdp else f"{trained}.fsdp=true {trained}.cpu_offload=true"
            out.append((name, {f"{trained}.cpu_offload": True, f"{trained}.fsdp": True}))
        if trained == "actor" and cfg.model.lora_rank == 0:
            out.append(("model.lora_rank=16", {"model.lora_rank": 16}))
        budget = rc.max_tokens_per_micro_batch
        for tokens in (8192, 4096, 2048):
            tokens_now, _, _ = _micro(cfg, trained)
            if tokens < tokens_now and not budget:
                out.append(
                    (
                        f"model.pack_sequences=true {trained}.max_tokens_per_micro_batch={tokens}",
                        {"model.pack_sequences": True, f"{trained}.max_tokens_per_micro_batch": tokens},
                    )
                )
                break
        if not cfg.model.gradient_checkpointing:
            out.append(("model.gradient_checkpointing=true", {"model.gradient_checkpointing": True}))
        micro = rc.micro_batch_size
        while micro > 1 and not budget:
            micro //= 2
            out.append((f"{trained}.micro_batch_size={micro}", {f"{trained}.micro_batch_size": micro}))
    if role == "reference":
        ref = cfg.reference
        out.append(
            (
                f"reference.micro_batch_size={max(1, ref.micro_batch_size // 4)}",
                {"reference.micro_batch_size": max(1, ref.micro_batch_size // 4)},
            )
        )
    return out


def _changed(cfg: Config, changes: dict[str, Any]) -> Config:
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(new, section), name, value)
    return new


def _fits(cfg: Config, role: str, plan_of, gpu_gib: float) -> bool:
    try:
        plan = plan_of(cfg)
    except ConfigError:
        return False
    return not any(g.role == role for g in plan.misfits(gpu_gib))


def check_fits(cfg: Config, plan_of, gpu_gib: float) -> None:
    """Raise DoesNotFit, in one line, when a kind of GPU's peak exceeds `gpu_gib` (or an engine cannot hold
    one sequence), naming for each such role the changes that make it fit: single keys first (of a series,
    the first that fits: the fewest nodes, the largest micro-batch), else pairs of them. `plan_of(cfg)`
    plans a config (`plan_memory` with the model's shapes)."""
    plan = plan_of(cfg)
    clauses = [_fix_clause(cfg, g, plan_of, gpu_gib) for g in plan.misfits(gpu_gib)]
    if clauses:
        raise DoesNotFit("; and ".join(clauses))


def _fix_clause(cfg: Config, g: GpuPlan, plan_of, gpu_gib: float) -> str:
    phase, peak = g.peak
    problem = g.extra_misfit or f"{g.role} needs {peak:.1f} GiB per GPU ({phase}) but a GPU has {gpu_gib:g} GiB"
    candidates = _candidates(cfg, g.role)
    singles: list[str] = []
    for name, changes in candidates:
        if name.split("=")[0] in {s.split("=")[0] for s in singles}:
            continue  # a series (nodes, micro-batch): its first size that fits
        if _fits(_changed(cfg, changes), g.role, plan_of, gpu_gib):
            singles.append(name)
    if singles:
        return f"{problem}: set {'; or '.join(singles[:6])}; or use GPUs with more memory"
    pairs: list[str] = []
    for i, (n1, c1) in enumerate(candidates):
        for n2, c2 in candidates[i + 1 :]:
            if n1.split("=")[0] == n2.split("=")[0] or len(pairs) >= 3:
                continue
            if _fits(_changed(cfg, {**c1, **c2}), g.role, plan_of, gpu_gib):
                pairs.append(f"{n1} with {n2}")
    if pairs:
        return f"{problem}: no single key makes it fit; set {'; or '.join(pairs)}"
    keys = ", ".join(sorted({n.split("=")[0] for n, _ in candidates}))
    return (
        f"{problem}: no one or two of {keys} make it fit: give it more GPUs ({g.keys}) together with them, "
        f"or use GPUs with more memory"
    )
