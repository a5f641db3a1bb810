"""The sections of the configuration tree (run, model, trainer, optim, checkpoint,
distributed, log, plan; data in data_section.py, dpo and kto in preference.py, embedding in embedding.py, rl in rl.py): typed
dataclasses that OmegaConf checks. The docstring under each field is that key's one
description: `paratrain config show`, the unknown-key error and the docs' Config keys page are
made from it (config/docs.py). tree.py joins them into `TrainConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from .checks import parse_nnodes

@dataclass
class RunConfig:
    """Where a run's outputs go (its run dir) and whether it may replace an earlier run."""
    name: Optional[str] = None
    """The run's name; null: stdlib-llama for the default job, `<model folder>-<format>` (and
    `-lora`, `-reward`, ...) for fine-tuning."""
    dir: Optional[str] = None
    """The run dir; null: runs/<run.name>."""
    overwrite: bool = False
    """Allow writing into a run dir that already holds another run (it is replaced)."""


@dataclass
class LoraConfig:
    """LoRA adapters (via peft) on a Hugging Face model: r=0 trains every weight."""
    r: int = 0
    """Rank of the adapters; 0: off (full fine-tuning). Needs `pip install 'paratrain[lora]'`."""
    alpha: float = 16.0
    """LoRA's scale (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout)."""
    target_modules: Any = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names (a bare name is a list of one) or `all-linear`; a name that matches no module
    is refused before the data is read, listing the model's linear layers."""
    bias: str = "none"
    """none | all | lora_only: which biases are trained (passed to peft as it is)."""
    modules_to_save: Optional[List[str]] = None
    """Modules trained in full beside the adapters (passed to peft as it is)."""
    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA; passed to peft as it is)."""
    use_rslora: bool = False
    """Scale the adapters by alpha/sqrt(r) instead of alpha/r (passed to peft as it is)."""
    init_lora_weights: Any = True
    """true | false | gaussian | pissa | olora | loftq | ... (passed to peft as it is)."""
    layers_to_transform: Optional[List[int]] = None
    """Only these layer indices get adapters; null: every layer (passed to peft as it is)."""


@dataclass
class ModelConfig:
    """What is trained: a built-in Llama or GPT from scratch, or a local Hugging Face model."""
    arch: str = "llama"
    """llama | gpt (built in, trained from scratch) | hf: a local Hugging Face model folder at
    model.path (a causal LM, an encoder-decoder such as T5, or any model a classification head
    fits; `pip install 'paratrain[hf]'`)."""
    path: Optional[str] = None
    """model.arch=hf: a folder with config.json (and usually weights and a tokenizer), as
    `save_pretrained` writes it, or a Hugging Face Hub id (org/name): read from huggingface_hub's
    cache (HF_HUB_CACHE), downloaded into it once when missing unless HF_HUB_OFFLINE=1; the
    config then holds the snapshot folder, whose path names the id and the commit."""
    revision: Optional[str] = None
    """model.path as a Hub id: the branch, tag or commit to read (null: main); once resolved, the
    commit it stood for (config.yaml records it, so a run is reproducible)."""
    trust_remote_code: bool = False
    """Allow a model whose config.json names its own Python code (auto_map); refused otherwise,
    since loading would run that code with your rights. Passed to transformers wherever a run
    loads its folders (model.path, dpo.reference, rl.reward_models), for every task; `paratrain
    generate` on a finished run's folder does not run such code yet."""
    preset: Optional[str] = "small"
    """A shape that fills the unset sizes below: tiny, small (~6.5M), medium (~16M), base
    (~125M), large (~350M), llama3-8b, llama3-70b, llama3-405b (Llama 3's published shapes)."""
    hidden_size: Optional[int] = None
    """Width of the residual stream; null: the preset's."""
    num_layers: Optional[int] = None
    """Transformer blocks; null: the preset's."""
    num_heads: Optional[int] = None
    """Attention heads; null: the preset's."""
    num_kv_heads: Optional[int] = None
    """llama: key/value heads (grouped-query attention); null: the preset's."""
    intermediate_size: Optional[int] = None
    """Width of the MLP; null: derived from hidden_size per architecture."""
    vocab_size: Optional[int] = None
    """Embedding rows; null: the tokenizer's vocabulary."""
    max_seq_length: Optional[int] = None
    """Positions the model supports; null: data.seq_length."""
    tie_embeddings: Optional[bool] = None
    """Share the token embedding with the output projection; null: the architecture's default
    (gpt ties, llama does not)."""
    dropout: float = 0.0
    """Dropout probability in the built-in models."""
    rope_theta: Optional[float] = None
    """RoPE base; null: the preset's, else 10000."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    init: str = "gpt2"
    """llama / gpt from scratch: gpt2 (N(0, 0.02), residual projections scaled by
    1/sqrt(2 x layers)) | torch (each layer's own default, as a model written with plain
    nn.Linear / nn.Embedding gets)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on an hf model instead of training every weight."""
    quantize: Optional[str] = None
    """null | nf4 (QLoRA: the frozen base's linear layers in 4-bit NormalFloat, about a quarter
    of their bf16 memory) | int8: through bitsandbytes (`pip install bitsandbytes`; its CPU
    backend too), with LoRA adapters (model.lora.r) trained in full precision on pairs / chat;
    DDP or one device (FSDP2 cannot shard bitsandbytes' packed weights); the merged model/ is
    merged onto the full-precision base."""


@dataclass
class TrainerConfig:
    """Devices, parallelism, batch, length and the training loop's options."""
    devices: Any = "auto"
    """auto (all GPUs, else cpu:N with N = min(2, cores)) | cpu:N (N CPU workers) | gpu:N (the
    first N GPUs) | [0, 1] | cuda:0,1 (GPUs 0 and 1: cuda:N names GPU N, as in torch) | cuda |
    cpu. On several nodes: this node's devices."""
    strategy: str = "auto"
    """auto (picked from the memory plan) | ddp | fsdp (FSDP2, per block) | hsdp (sharded within
    a node, replicated across nodes) | dp (nn.DataParallel, GPUs) | single."""
    precision: str = "fp32"
    """fp32 | bf16-mixed | fp16-mixed | bf16-true."""
    batch_size: int = 8
    """Sequences per device (per data-parallel group with tensor parallelism) per micro-step."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step over all workers; gradient accumulation is derived, so the
    run is the same on 1 or 8 workers. null: batch_size x data-parallel workers."""
    max_steps: Optional[int] = 200
    """Optimizer steps to train; null: train trainer.epochs epochs. Setting trainer.epochs
    without it (in the same file or override list, or a later one) sets it to null: the epochs
    you set win over this default."""
    epochs: int = 1
    """Epochs to train when trainer.max_steps is null (set alone, it nulls max_steps)."""
    seed: int = 1337
    """Seeds the weights, the data order and dropout."""
    log_every: int = 10
    """Optimizer steps per metrics.jsonl line and log line."""
    eval_every: int = 100
    """Optimizer steps between evaluations on the validation data; 0: no evaluation at all
    (neither during the run nor at its end)."""
    eval_samples: Optional[int] = 1024
    """Evaluate on the first N held-out samples (windows, rows or examples; with data.pack=true
    packed rows, each holding several examples): a bound that keeps each evaluation short on a
    large corpus (the log says when it leaves samples out); null: every held-out sample once,
    whatever its size."""
    verbose: bool = False
    """A memory table per rank at start, after each epoch and at the end."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them."""
    compile: bool = False
    """torch.compile the model."""
    cpu_offload: bool = False
    """fsdp: keep parameters, gradients and optimizer state in host RAM."""
    reshard_after_forward: bool = True
    """fsdp: free the gathered parameters after forward (less memory, one more all-gather)."""
    shard_group_size: Optional[int] = None
    """hsdp: processes per shard group; must divide the world size (null: those of a node)."""
    tensor_parallel: int = 1
    """Processes of a node that split each layer's matrices (1: off)."""
    pipeline_parallel: int = 1
    """Pipeline stages: consecutive blocks of the built-in llama / gpt on different processes
    (1: off)."""
    pipeline_schedule: str = "1f1b"
    """1f1b | gpipe | interleaved-1f1b | zero-bubble (the last two: 2 stages per process)."""
    pipeline_split: Optional[List[int]] = None
    """Blocks per stage, in stage order, e.g. [3, 1]; null: as even as possible."""
    context_parallel: int = 1
    """Processes that split each sequence (context parallelism: head-tail chunks, attention over
    the whole sequence by all-gathered keys and values); built-in llama / gpt on packed data
    (1: off)."""
    progress_bar: bool = True
    """Draw a progress bar (global rank 0 only)."""
    early_stopping_patience: Optional[int] = None
    """Stop after N evaluations without improvement; null: never."""
    early_stopping_threshold: float = 0.0
    """An improvement lowers the best validation loss by more than this."""
    keep_best: bool = False
    """The output (model/, adapter/) is the weights of the best evaluation, not the last step's."""
    label_smoothing: float = 0.0
    """Label smoothing of the token / text cross-entropy while training (not validation)."""
    neftune_noise_alpha: Optional[float] = None
    """Fine-tuning formats: NEFTune noise of +-alpha/sqrt(T x C) on the input embeddings while
    training (T the padded length; with data.pack=true each example's own length); null: off."""
    objective: str = "auto"
    """What data.format trains: auto (the format's first) | lm | sft | classify | setfit
    (classify data) | dpo | kto | reward (preference data) | seq2seq (pairs on an
    encoder-decoder model) | embedding | grpo | rloo | ppo (prompts; rl.*)."""


@dataclass
class OptimConfig:
    """The optimizer and the learning-rate schedule (runtime/optim.py)."""
    name: str = "adamw"
    """adamw | adafactor | sgd | adamw-8bit (bitsandbytes' AdamW8bit; pip install
    bitsandbytes)."""
    lr: float = 2e-3
    """The peak learning rate."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """adamw: the moments' decay rates."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    decay_norms_and_biases: bool = False
    """false: weight decay on matrices only (>= 2-D parameters); true: on every parameter."""
    eps: float = 1e-8
    """adamw: the denominator's epsilon."""
    momentum: float = 0.0
    """sgd only: momentum."""
    fused: Optional[bool] = None
    """adamw: the fused kernel; null: fused on CUDA, foreach elsewhere."""
    schedule: str = "cosine"
    """cosine | linear (to optim.min_lr) | constant | wsd (warmup, stable, decay)."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    warmup_ratio: Optional[float] = None
    """Set: the warmup is this fraction of the run's steps (rounded up), instead of
    optim.warmup_steps."""
    warmup_start_factor: Optional[float] = None
    """The warmup goes from lr x this to lr (torch's LinearLR; 0: HF Trainer's); null: step k of
    W uses lr x (k+1)/W."""
    decay_ratio: float = 0.1
    """wsd: the fraction of the run's steps spent decaying at the end."""
    min_lr: Optional[float] = None
    """Where the decay ends; null: lr / 10; 0: to zero (HF Trainer's)."""
    grad_clip: float = 1.0
    """Clip the gradients' norm to this; 0 disables clipping."""

    @property
    def floor_lr(self) -> float:
        """min_lr, or lr / 10 when unset."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass
class CheckpointConfig:
    """Sharded snapshots (torch.distributed.checkpoint) and resuming from them."""
    dir: Optional[str] = None
    """A path or fsspec URL such as s3://bucket/x; null: <run.dir>/checkpoints."""
    every_steps: int = 0
    """A snapshot after every N optimizer steps; 0: none."""
    at_epoch_end: bool = False
    """Also a snapshot after each epoch's last step (every_steps=0: only then)."""
    keep_last: int = 2
    """Committed snapshots to keep."""
    resume: str = "auto"
    """auto (the newest committed snapshot, if any) | never | a snapshot folder (step-NNNNNNN)."""
    async_save: bool = True
    """Write in the background; false: the loop waits for the write."""
    max_failed_saves: int = 3
    """Snapshots that cannot be written in a row before the run stops."""
    record_samples: bool = False
    """Test aid: samples.jsonl lists each step's sample ids."""


@dataclass
class DistributedConfig:
    """Processes, nodes, the rendezvous and restarts."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, as the other nodes see it."""
    master_port: int = 0
    """Node 0's port; 0: pick a free port (single node only)."""
    nnodes: Any = 1
    """N nodes, or MIN:MAX for elastic membership (torch's c10d rendezvous)."""
    node_rank: int = 0
    """This node's rank, 0..nnodes-1."""
    timeout_s: float = 300.0
    """How long a collective (and the rendezvous) may wait before the job fails instead of
    hanging."""
    max_restarts: int = 0
    """Restart the workers (from the last snapshot) this many times when one dies."""
    backend: str = "auto"
    """auto (nccl on GPUs, gloo on CPU) | nccl | gloo."""
    rdzv: str = "static"
    """static: node_rank fixes the order | c10d: torch's dynamic rendezvous (ranks by arrival)."""
    requeue: bool = False
    """Under Slurm: after a stop signal's snapshot, scontrol requeue the job."""

    @property
    def min_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        """nnodes=MIN:MAX with MIN < MAX: nodes may leave and join (the job re-forms)."""
        low, high = parse_nnodes(self.nnodes)
        return low < high


@dataclass
class LogConfig:
    """Run records besides metrics.jsonl; see loggers.py and report.py."""
    tensorboard: Optional[bool] = None
    """<run dir>/tensorboard/; null: on when tensorboard is installed."""
    wandb: bool = False
    """Weights & Biases (pip install wandb)."""
    mlflow: bool = False
    """MLflow (pip install mlflow)."""
    project: Optional[str] = None
    """The wandb project / mlflow experiment; null: paratrain."""
    report: bool = True
    """Draw report.png in the run dir at the end (needs matplotlib)."""


@dataclass
class PlanConfig:
    """`paratrain plan`'s target layout, simulated without processes (null: this machine's)."""
    nodes: Optional[int] = None
    """Nodes in the job."""
    devices_per_node: Optional[int] = None
    """Processes (GPUs) per node."""
    device_memory_gb: Optional[float] = None
    """Memory of one device, GB (10^9 bytes)."""
