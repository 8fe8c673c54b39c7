"""One typed config for the trainer: a YAML preset plus `key=value` overrides.

    cfg = load_config("local", ["algorithm.name=grpo", "actor.lr=1e-5"])

Presets live in `trainer/presets/<name>.yaml` (or any YAML path). Every key is checked against the
dataclasses below: an unknown key fails with the closest valid one, a wrong type names the key and the
type it wants, and batch sizes that don't divide say which key to change. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from .config_checks import choices, validate
from .errors import ConfigError  # noqa: F401  (raised by the loading below; imported from here by callers)

# PRESET_DIR, available_presets and preset_path are imported from here by the CLI and the tests, too.
from .presets import (
    PRESET_DIR,  # noqa: F401
    apply_mapping,
    available_presets,  # noqa: F401
    parse_override,
    preset_layers,
    preset_path,
    set_key,
)

# Keys with a fixed set of values: `coerce` rejects anything else, `--help-config` lists them.
Dtype = Literal["float32", "bfloat16", "float16"]
Engine = Literal["hf", "vllm", "sglang"]
GroupAlgorithm = Literal["grpo", "rloo", "reinforce_pp_baseline"]  # they compare the samples of one prompt
Algorithm = Literal["ppo", "reinforce_pp", GroupAlgorithm]
KlMode = Literal["reward", "loss"]
KlEstimator = Literal["k1", "k2", "k3"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
ALGORITHMS: tuple[str, ...] = typing.get_args(Algorithm)
GROUP_ALGORITHMS: tuple[str, ...] = typing.get_args(GroupAlgorithm)


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"
    """Policy model: a local directory or hub name for AutoModelForCausalLM, or `builtin:tiny`."""
    dtype: Dtype = "float32"
    """Training dtype."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (saves memory on big models)."""
    trust_remote_code: bool = False
    """Allow model code from the hub (only for models you trust)."""
    sft_warmup_steps: int = 0
    """Supervised steps on the task's answer format before RL (the built-in task only)."""
    sft_warmup_lr: float = 3e-3
    """Learning rate of the format warm-up."""
    attn_implementation: AttnImplementation = "sdpa"
    """Attention kernel of the actor, critic and reference forward passes: sdpa (torch's own, CPU or GPU), eager
    (plain matmuls), flash_attention_2 (GPUs with the flash-attn package, model.dtype bfloat16 or float16)."""
    compile: bool = False
    """torch.compile each transformer block of the actor, critic and reference forward passes (Inductor: the
    norms, activation and rotary fused into few kernels); the first updates pay for the compilation. Needs a
    C++ compiler on CPU workers."""
    pack_sequences: bool = False
    """Run the actor, critic and reference forward passes on each micro-batch's sequences concatenated without
    padding (positions restart and attention stays within each sequence); pays off when lengths vary a lot."""
    lora_rank: int = 0
    """LoRA rank of the actor's adapters (peft): the base weights stay frozen, the actor trains the adapters only
    and its reference is the base model with the adapters off. 0 = off (full fine-tuning). The critic always
    trains in full. LoRA usually wants a higher actor.lr than full fine-tuning (about 10x)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter adds B @ A * lora_alpha / lora_rank to its layer's weight."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get adapters, by name suffix (e.g. [q_proj,k_proj,v_proj,o_proj]); all-linear = every
    linear layer of the transformer blocks (attention and MLP projections), not the output head."""


@dataclass
class DataConfig:
    train_files: str = "builtin:arithmetic"
    """Prompts, comma separated: .jsonl/.parquet files, hf:DATASET[:CONFIG][@SPLIT] (docs/data.md),
    builtin:arithmetic."""
    val_files: str = ""
    """Held-out prompts for validation (an hf: entry's split defaults to test); empty = the built-in
    task's, else none."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages."""
    answer_key: str = ""
    """Column holding the reward's ground truth; empty = reward_model.ground_truth, else ground_truth, else answer."""
    prompt_template: str = ""
    """Wraps each prompt (a chat prompt's last user message), {prompt} marking where it goes; empty = as is."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens) are left-truncated."""
    train_batch_size: int = 16
    """Prompts per PPO step (each is sampled `rollout.n` times)."""
    val_batch_size: int = 64
    """Prompts per validation pass."""
    val_sets: dict[str, str] = field(default_factory=dict)
    """More validation sets, name -> files (as in data.val_files), e.g. {easy: easy.jsonl}; each is
    reported as val/<name>/..., beside data.val_files' set as val/...."""
    shuffle: bool = True
    """Shuffle prompts every epoch (seeded, so a resumed run sees the same order)."""
    arithmetic_max_operand: int = 4
    """Built-in task: operands are drawn from 0..this."""
    arithmetic_size: int = 2000
    """Built-in task: number of generated training prompts."""


@dataclass
class RolloutConfig:
    engine: Engine = "hf"
    """Generation engine: hf is transformers' generate, vllm needs the `vllm` extra, sglang the `sglang` extra
    (GPU nodes only; docs/engines.md)."""
    n: int = 4
    """Samples per prompt (the group size for GRPO/RLOO)."""
    max_new_tokens: int = 8
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, in addition to the tokenizer's end-of-sequence token."""
    num_engines: int = 1
    """Rollout engines (Ray actors); prompts are split across them."""
    tensor_parallel_size: int = 1
    """Tensor-parallel GPUs per vLLM or SGLang engine (per pipeline stage)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per vLLM or SGLang engine: an engine uses tensor_parallel_size x pipeline_parallel_size GPUs."""
    nodes_per_engine: int = 1
    """Nodes one vLLM or SGLang engine spans. 1: all its GPUs on one node. More: its tensor_parallel_size x
    pipeline_parallel_size GPUs are that many one-GPU Ray bundles over several nodes, driven by vLLM's Ray
    executor (SGLang: one process per node); the engine's own actor holds no GPU (docs/engines.md)."""
    gpus_per_engine: float = 0.0
    """GPUs per HF engine (vLLM uses tensor_parallel_size). 0 = CPU."""
    cpus_per_engine: float = 1.0
    """CPUs per engine."""
    gpu_memory_utilization: float = 0.85
    """vLLM: share of each engine GPU for weights and KV cache. Unless set, 0.85 where the engines own their
    GPUs and 0.5 with placement.colocate_all, where the trainers keep their weights and optimizer state."""
    sleep_between_rollouts: bool = False
    """vLLM: free weights and KV cache while the policy trains (always on with placement.colocate_all, where
    false is refused)."""
    weight_push_bucket_mb: int = 1024
    """SGLang's NCCL weight push: at most this many MiB of tensors per `update_weights_from_distributed` call
    (a larger tensor goes alone). SGLang allocates every receive buffer of a call at once on each engine GPU,
    so one call for a whole 7B model would need ~15 GB more per GPU."""
    logprob_correction: bool = False
    """Reweight the policy loss with importance weights of the trainer's log-probs over the engine's."""
    logprob_correction_mode: Literal["token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis"] = "token_tis"
    """Which weights (algo/ppo_math.py `rollout_correction`): truncated per token (token_tis) or per sequence
    (seq_tis), or 0/1 masks that drop a token (token_mis), a sequence by its ratio (seq_mis) or by the
    geometric mean of its tokens' ratios (geo_mis) outside [1/cap, cap]."""
    logprob_correction_cap: float = 2.0
    """Upper bound of those weights (truncated modes), or of the ratios kept (masked modes, the lower bound
    its reciprocal; geo_mis compares a mean per token: a bound near 1, such as 1.001)."""
    max_staleness: int = 0
    """k >= 1: the engines generate the next k steps' rollouts (with the weights before this step's update)
    while this step trains, so a sample is at most k weight versions old, and the lag is corrected with the
    importance weights above; 0: in turn. At most 4; a step that validates or checkpoints is not generated
    ahead of. Also accepted as `rollout.policy_lag`, its older name."""
    partial: bool = False
    """With max_staleness >= 1, partial rollouts: the engines generate in segments and take the weights pushed
    meanwhile between two segments, so a batch in flight continues its unfinished samples from their prefixes
    with the newer policy (rollout/partial.py); each token records its weight version. Single-turn generation
    with the weights through Ray's object store; elsewhere the run says so at start and generates whole."""
    partial_segment_tokens: int = 0
    """With rollout.partial: the tokens generated between two looks for new weights; 0 = a quarter of
    rollout.max_new_tokens."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per engine, e.g. {h100: 1} to pin engines to nodes started with them."""
    elastic: bool = False
    """Add engines while the run goes, up to rollout.max_engines: one more engine waits for room on the cluster
    (a node that joins, spot capacity) and generates from the first push after it has started
    (docs/recovery.md). Where the weights go through the object store (engines on CPU, or not next to a CUDA
    actor), with engines that stay awake and fit on one node."""
    max_engines: int = 0
    """With rollout.elastic: the most engines at once (above rollout.num_engines, the engines the run starts with)."""

    @property
    def ranks_per_engine(self) -> int:
        """The GPU processes (and GPUs) of one vLLM or SGLang engine: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    environment: str = ""
    """Multi-turn episodes against your environment class: `path/to/env.py:MyEnv` or `module:MyEnv` (reset(sample)
    -> first observation, step(action_text) -> StepResult; docs/agents.md). Empty = one turn per sample."""
    max_turns: int = 4
    """Multi-turn (rollout.environment or search.enabled): model turns per episode at most (the last turn's
    observation is dropped; with search, the calls of the first max_turns - 1 turns are answered)."""
    max_episode_tokens: int = 256
    """Multi-turn: generated plus observation tokens per episode (rollout.max_new_tokens is per turn)."""
    max_obs_tokens: int = 128
    """Multi-turn: tokens per observation; longer ones are cut (with search, the passages, tags kept)."""
    episode_timeout_s: float = 60.0
    """With rollout.environment: wall time per episode; an environment call still running then ends its episode
    (counted in env/timeouts_per_sample), as one that raises does (env/env_errors_per_sample)."""


@dataclass
class SearchConfig:
    enabled: bool = False
    """Multi-turn rollouts with a search tool (<search>q</search> -> <information>...</information>);
    docs/search-r1.md."""
    url: str = "http://127.0.0.1:8000/retrieve"
    """Retriever each rollout worker queries (127.0.0.1: the one on its own node)."""
    topk: int = 3
    """Passages per search call."""
    timeout_s: float = 10.0
    """Per-request timeout of the retrieval client."""
    retries: int = 2
    """Retries of a request that timed out or found no server."""


@dataclass
class AlgorithmConfig:
    name: Algorithm = "ppo"
    """Advantage estimator: ppo is GAE with a critic; grpo, rloo, reinforce_pp_baseline compare a prompt's samples."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalise PPO advantages over the batch (GRPO/RLOO normalise per group)."""
    kl_coef: float = 0.001
    """KL weight against the reference policy (0 = no reference model is loaded)."""
    kl_mode: KlMode = "reward"
    """Where KL enters: `reward` (token-level penalty) or `loss` (a loss term). Unless set, `loss` for grpo
    and reinforce_pp_baseline (their std scaling would blow KL noise in the scores up), `reward` for the others."""
    kl_estimator: KlEstimator = "k1"
    """KL estimator (see ppo_math.kl_estimate). Unless set, k3 with kl_mode=loss (as GRPO), k1 with kl_mode=reward."""
    kl_target: float = 0.0
    """> 0 turns on the adaptive KL controller with this target."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon."""
    grpo_norm_by_std: bool = True
    """GRPO: divide by the group's standard deviation."""
    mask_truncated: bool = False
    """Leave responses cut off at the length limit (finish_reason `length`) out of the loss (DAPO's overlong filtering)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a score penalty growing linearly over this many tokens before the
    response length limit (rollout.max_new_tokens; rollout.max_episode_tokens multi-turn). 0 = off."""
    overlong_penalty: float = 1.0
    """The overlong penalty at the length limit (it ramps from 0 to minus this)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (group algorithms): drop prompts whose samples all score the same and
    sample more prompts until data.train_batch_size prompts remain whose samples differ."""
    max_sampling_rounds: int = 8
    """Dynamic sampling: generation rounds per step at most; then the step trains on the groups it kept
    (topped up with equal-score groups, rollout/filled_uniform), or the run ends when no round kept any."""


@dataclass
class RoleConfig:
    """Placement of one role's workers: `nodes` x (`gpus_per_node` or `workers_per_node`)."""

    nodes: int = 1
    """Nodes the role spans."""
    gpus_per_node: int = 0
    """GPUs per node; one worker per GPU. 0 = CPU workers."""
    workers_per_node: int = 1
    """CPU workers per node (used when gpus_per_node is 0)."""
    cpus_per_worker: float = 1.0
    """CPUs each worker reserves."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per worker, e.g. {h100: 1}."""

    @property
    def world_size(self) -> int:
        return self.nodes * (self.gpus_per_node if self.gpus_per_node > 0 else self.workers_per_node)


@dataclass
class TrainedRoleConfig(RoleConfig):
    """What the two trained roles (actor and critic) share: optimizer, batches, sharding."""

    lr: float = 1e-6
    """Learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 64
    """Sequences per optimizer step (global, across workers)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one worker."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward: a micro-batch holds as many sequences as fit (real tokens with
    model.pack_sequences, else rows x the batch width; a longer sequence goes alone). 0 = micro_batch_size."""
    fsdp: bool = True
    """Shard with FSDP2 when the role has several workers or GPUs (NCCL on GPUs, gloo on CPU)."""
    cpu_offload: bool = False
    """FSDP2: keep parameters and optimizer state on CPU."""


@dataclass
class ActorConfig(TrainedRoleConfig):
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (raise it for clip-higher)."""
    dual_clip: float = 0.0
    """Dual-clip bound c > 1 for negative advantages (0 = off)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy objective: ppo (token ratio, clipped), gspo (sequence ratio, clipped; choosing it makes 3e-4/4e-4
    clipping and seq-mean-token-mean the defaults of the keys not set), cispo (clipped, detached ratio times
    log-prob; clip_low=1 bounds it from above only); clip_low/clip_high bound each one's ratio."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses add up: mean over tokens, mean over responses of their token mean or token sum, or
    Dr. GRPO's token sum over a constant (the response length limit); each over the whole mini-batch."""


@dataclass
class CriticConfig(TrainedRoleConfig):
    lr: float = 1e-5
    """Critic learning rate."""
    model_path: str = ""
    """Value model; empty = the policy's path (a value head is added)."""
    clip_value: float = 0.2
    """Value clipping range (0 = off)."""


@dataclass
class ReferenceConfig(RoleConfig):
    micro_batch_size: int = 32
    """Sequences per forward pass."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward pass, as actor.max_tokens_per_micro_batch (0 = micro_batch_size)."""


@dataclass
class RewardConfig(RoleConfig):
    function: str = "arithmetic"
    """Reward: a built-in name, `module:function` or `path/to/file.py:function`."""
    model_path: str = ""
    """Optional reward model (AutoModelForSequenceClassification); its score is added."""
    model_weight: float = 1.0
    """Weight of the reward model's score."""
    micro_batch_size: int = 32
    """Sequences per reward-model forward pass."""
    in_driver: bool = False
    """Score rule-based rewards in the driver process: no reward workers (not with a reward model)."""
    timeout_s: float = 60.0
    """Longest one call of the reward function (one engine's part of a batch) may take; a call still
    running then stops the run with a line naming the function (0 = no limit)."""
    url: str = ""
    """HTTP scorer (http://host:port/score) sent {"items": [{prompt, response, ground_truth}]}, answering
    {"scores": [...]}; its score times url_weight is added to reward.function's (function=none: it alone)."""
    url_weight: float = 1.0
    """Weight of the reward.url score."""
    url_timeout_s: float = 30.0
    """Longest one reward.url request may take, from connecting to the answer's last byte; then it is retried."""
    url_retries: int = 3
    """Retries of a reward.url request that fails to connect, times out or gets HTTP 5xx/429 (with back-off)."""
    url_max_concurrency: int = 4
    """reward.url requests in flight at once, per reward worker."""
    url_batch_size: int = 64
    """Samples per reward.url request."""
    url_token_env: str = ""
    """Name of an environment variable whose value goes to reward.url as `Authorization: Bearer`; the
    value itself never appears in the config or the logs."""
    url_insecure_http: bool = False
    """Let the url_token_env token go over plain http:// to a host other than this machine, where anyone on
    the network path can read it (default: only https:// or a loopback address)."""


@dataclass
class PlacementConfig:
    colocate_actor_ref: bool = True
    """Keep the reference model in the actor's worker processes (no extra processes or GPUs)."""
    colocate_critic_reward: bool = False
    """Put reward workers on the critic's GPUs (shared placement group bundles)."""
    colocate_all: bool = False
    """Hybrid engine: every role and the rollout engines share the actor's GPUs; vLLM engines sleep while the
    policy trains, and the critic updates before the actor, not beside it."""
    rollout_in_actor: bool = False
    """HF engine: the actor's workers generate with the policy they train (no rollout workers, no weight sync)."""
    timeout_s: float = 60.0
    """Fail when placement groups are not ready after this long (instead of hanging)."""
    check_versions: bool = True
    """Before any worker starts, every node the roles landed on reports Python, torch, transformers, vLLM,
    SGLang, Ray, peft, CUDA, NCCL, the NVIDIA driver and its GPU model; a node that differs stops the job with
    one line (roles/versions.py). false: run anyway."""


@dataclass
class TrainerConfig:
    total_steps: int = 20
    """PPO steps to run."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    run_dir: str = ""
    """Where metrics, checkpoints and the exported model go (a local disk or a mounted volume). Empty:
    runs/<preset name>, so every preset and every preset file has a directory of its own."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints to keep."""
    resume: str = "auto"
    """`auto` (latest checkpoint in run_dir if any), `never`, or a checkpoint directory."""
    val_every: int = 0
    """Validate every N steps with greedy decoding (0 = only before and after training)."""
    sample_every: int = 50
    """Print one sampled prompt, its response and its reward on step 1 and every N steps after (0 = never)."""
    val_n: int = 1
    """Samples per validation prompt besides the greedy one: > 1 also reports mean@n and pass@k
    (k = 1, 2, 4, ... up to n) at trainer.val_temperature; 1 = greedy only."""
    val_temperature: float = 1.0
    """Sampling temperature of the trainer.val_n validation samples."""
    eval_only: bool = False
    """Score the model on the validation sets without training: the checkpoint trainer.resume picks
    (auto: run_dir's latest) or, without one, model.path; prints a table and writes run_dir/eval.json."""
    loggers: list[Logger] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks (wandb reads its key from WANDB_API_KEY; mlflow logs to trainer.mlflow_tracking_uri or
    MLFLOW_TRACKING_URI). Resumes and restarts continue the same W&B and MLflow run (docs/trainer.md, Metrics)."""
    wandb_project: str = ""
    """W&B project (the key is read from WANDB_API_KEY; never printed). Empty: cloudrl."""
    wandb_entity: str = ""
    """W&B team or user the project belongs to. Empty: the key's default entity."""
    wandb_group: str = ""
    """W&B group that gathers related runs (a sweep, the branches of one run). Empty: none."""
    wandb_run_name: str = ""
    """W&B run name. Empty: the name of trainer.run_dir."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server (http://host:5000) or store (sqlite:///path.db). Empty: MLFLOW_TRACKING_URI from
    the environment. Never credentials: MLflow reads MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME and
    MLFLOW_TRACKING_PASSWORD from the environment."""
    mlflow_experiment: str = ""
    """MLflow experiment the run logs to (created when missing). Empty: cloudrl."""
    export_hf: bool = True
    """Save the final policy with save_pretrained into run_dir/hf_model."""
    ray_address: str = ""
    """Ray cluster to join; empty = the one the job was submitted to, or a new local one."""
    worker_timeout_s: float = 600.0
    """Longest wait for a worker to start, join its process group or finish a weight sync (then stop with a line)."""
    gap_check: Literal["warn", "fail", "off"] = "warn"
    """On the first step of every start and restart, before anything trains: the trainer's log-probs of the
    engines' samples against the engines' own. Above trainer.gap_check_max_k3 the engines compute another
    distribution than the one trained (a dtype, tokenizer or chat template of their own, weights not
    loaded): `warn` prints one line and trains on, `fail` stops the run with it. Skipped where sampling
    truncates the distribution (rollout.top_p < 1, rollout.top_k > 0), whose log-probs differ by design."""
    gap_check_max_k3: float = 0.01
    """The largest engine-trainer gap the check accepts: the mean over sampled tokens of rho - log rho - 1,
    rho = exp(trainer - engine) (`rollout/logprob_gap_k3`; float32 on CPU ~1e-12, bfloat16 on GPUs ~1e-4)."""
    hang_timeout_s: float = 600.0
    """Longest wait on the loop's calls to the workers (generation, rewards, log-probs, values, updates): the
    larger of this and 5x that phase's median so far. Past it, every stuck worker's Python stack is kept in
    run_dir/hangs/, one line names where each is stuck, and the roles restart from the latest checkpoint
    (trainer.max_restarts). 0: unbounded, as a wait without a watchdog."""
    peak_tflops: float = 0.0
    """Peak dense TFLOPs of one device in the compute dtype, for the perf/*_mfu metrics. 0: from the table of
    known GPUs (by torch.cuda.get_device_name); on a CPU or an unknown GPU MFU is then not reported."""
    checkpoint_uri: str = ""
    """Also keep checkpoints here (s3://bucket/prefix, gs://..., via fsspec; credentials from the
    environment): uploaded after each save, fetched on resume=auto."""
    checkpoint_key_env: str = ""
    """The NAME of an environment variable holding a secret key (32 characters or more, e.g. `openssl rand
    -hex 32`): every checkpoint's manifest is then signed with it (HMAC-SHA256), and a resume accepts only a
    checkpoint whose signature matches, so whoever can write trainer.run_dir or the bucket cannot hand the
    run a checkpoint of their own. A job gets the key with `cloudrl submit --env NAME`."""
    max_restarts: int = 3
    """Times the run restarts its roles from the latest checkpoint after losing a worker, engine or node
    (0 = never)."""
    exclude_stragglers: bool = False
    """At a restart, leave out the nodes of the workers named as stragglers (stragglers.py) when the cluster
    holds every role without them; a straggler alone never causes a restart."""
    restart_wait_s: float = 600.0
    """Before a restart, longest wait for the cluster to have the capacity the config needs again (a
    replacement node)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    # Derived values, computed once in one place.
    @property
    def rollout_batch_size(self) -> int:
        """Sequences generated per step."""
        return self.data.train_batch_size * self.rollout.n

    @property
    def response_limit_key(self) -> str:
        """The key that bounds a response's tokens (multi-turn: observations included)."""
        if self.rollout.environment or self.search.enabled:
            return "rollout.max_episode_tokens"
        return "rollout.max_new_tokens"

    @property
    def response_limit(self) -> int:
        """The longest response the sampler may produce, in tokens: the constant of the overlong penalty and of
        actor.loss_agg_mode=seq-mean-token-sum-norm, and what the memory plan sizes."""
        section, key = self.response_limit_key.split(".")
        return getattr(getattr(self, section), key)

    @property
    def corrects_logprobs(self) -> bool:
        """The loss is reweighted by trainer-vs-sampler importance weights (asked for, or lagging rollouts)."""
        return self.rollout.logprob_correction or self.rollout.max_staleness > 0

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.name == "ppo"

    @property
    def critic_after_actor(self) -> bool:
        """The critic computes on the actor's GPUs (placement.colocate_all on GPUs): its forward passes and its
        update run after the actor's, so each GPU holds one role's activations at a time."""
        return self.uses_critic and self.placement.colocate_all and self.actor.gpus_per_node > 0

    @property
    def uses_groups(self) -> bool:
        """The advantage estimator compares the `rollout.n` samples of each prompt."""
        return self.algorithm.name in GROUP_ALGORITHMS

    @property
    def uses_reference(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def uses_reward_workers(self) -> bool:
        return not self.reward.in_driver

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def load_config(preset: str = "local", overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a checked Config from a preset and `section.key=value` overrides."""
    path = preset_path(preset)
    cfg = Config()
    for mapping, source in preset_layers(path):  # `base: local` first, then the file's own keys
        apply_mapping(cfg, mapping, source=source)
    for item in overrides:
        key, value = parse_override(item)
        set_key(cfg, key, value, source="command line")
    if not cfg.trainer.run_dir:  # a run never lands in another preset's directory by default
        cfg.trainer.run_dir = f"runs/{path.stem}"
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config saved with `to_dict` (e.g. from a checkpoint)."""
    cfg = Config()
    apply_mapping(cfg, data, source="saved config")
    validate(cfg)
    return cfg


def describe_keys(cfg: Config | None = None) -> str:
    """Every key with its value in `cfg` (a loaded preset; default: the code's defaults) and one-line doc:
    what `--help-config` prints. A value the preset changed also names the code's default; a numeric key
    names the values it takes."""
    from .config_checks import RANGES

    cfg = cfg or Config()
    lines = []
    for section in dataclasses.fields(Config):
        obj = getattr(cfg, section.name)
        default = getattr(Config(), section.name)
        lines.append(f"{section.name}:")
        docs = _field_docs(type(obj))
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            allowed = choices(hints[f.name])
            doc = docs.get(f.name, "") + (f" One of: {', '.join(allowed)}." if allowed else "")
            rule = RANGES.get(f"{section.name}.{f.name}")
            doc += f" Range: {rule.describe()}." if rule is not None and rule.describe() else ""
            value, was = getattr(obj, f.name), getattr(default, f.name)
            changed = f"  (default {was!r})" if value != was else ""
            lines.append(f"  {section.name}.{f.name} = {value!r}{changed}  # {doc}")
    return "\n".join(lines)


def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string right under each field), collected from the class source."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                # One line in `--help-config`, however the docstring wraps.
                docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs
