"""What a configuration may hold: the value sets of the choice keys, and the checks that need no
process (`validate`), each failing with one ConfigError line that names the key and the fix.

Kept apart from the config tree (tree.py) so that each stays readable; it reads the tree by
attribute, so it imports nothing from tree.py (no cycle). What an unset key resolves to is
defaults.py's; these only check.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError, check_choice
from ..formatting import count_of, one_of
from . import registry
from .defaults import resolve_tokenizer
from .formats import RECORDS
from .hub import is_hub_dataset
from .finetune_checks import check_data_format, check_hf_corpus_tokenizer
from .model_folder import check_remote_code, check_weights, model_config
from .presets import ARCHS, resolve_model_config

STRATEGIES = ("auto", "single", "ddp", "fsdp", "hsdp", "dp")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
BACKENDS = ("auto", "gloo", "nccl")
OPTIMIZERS = ("adamw", "adafactor", "sgd", "adamw-8bit")
SCHEDULES = ("cosine", "linear", "constant", "wsd")
INITS = ("gpt2", "torch")
# trainer.pipeline_schedule -> the stages each process runs (interleaved: 2, "virtual" stages;
# zero-bubble: the interleaved placement too; parallel/pipeline_schedules.py says what each is)
PIPELINE_SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "zero-bubble": 2}


def parse_nnodes(value: Any) -> tuple[int, int]:
    """`distributed.nnodes` as (MIN, MAX): N is (N, N); "MIN:MAX" is an elastic range."""
    text = str(value).strip()
    m = re.fullmatch(r"(-?\d+)(?::(-?\d+))?", text)
    if m is None or isinstance(value, bool):
        raise ConfigError(f"distributed.nnodes={value!r} must be a number of nodes N or a range "
                          "MIN:MAX (for example 2:4)")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if low < 1:
        raise ConfigError(f"distributed.nnodes={text}: the number of nodes must be at least 1")
    if low > high:
        raise ConfigError(f"distributed.nnodes={text}: MIN ({low}) is larger than MAX ({high}); "
                          f"write {high}:{low}")
    return low, high


def validate(cfg: Any) -> None:
    """Checks that need no process, on a TrainConfig. Raises ConfigError naming the key."""
    check_choice("model.arch", cfg.model.arch, ARCHS + ("hf",))
    check_choice("trainer.strategy", cfg.trainer.strategy, STRATEGIES)
    check_choice("trainer.precision", cfg.trainer.precision, PRECISIONS)
    spec = cfg.task_spec  # decided once; an unknown name lists the registered ones
    check_choice("data.padded_overflow", cfg.data.padded_overflow, ("truncate", "split"))
    check_choice("data.records", cfg.data.records, RECORDS)
    check_data_format(cfg, spec)
    if is_hub_dataset(cfg.data.source) and not spec.pretrained:
        raise ConfigError(f"data.source={cfg.data.source!r}: Hub datasets are read for the "
                          f"fine-tuning formats; for a corpus (data.format={cfg.data.format}) "
                          "save it with datasets' save_to_disk and pass that folder")
    check_choice("distributed.backend", cfg.distributed.backend, BACKENDS)
    check_choice("distributed.rdzv", cfg.distributed.rdzv, ("static", "c10d"))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", cfg.run.name):
        raise ConfigError(f"run.name={cfg.run.name!r} may hold only letters, digits, '.', '_' "
                          "and '-'")
    positive = {
        "data.seq_length": cfg.data.seq_length, "data.vocab_size": cfg.data.vocab_size,
        "trainer.batch_size": cfg.trainer.batch_size, "trainer.epochs": cfg.trainer.epochs,
        "trainer.log_every": cfg.trainer.log_every,
        "distributed.timeout_s": cfg.distributed.timeout_s,
    }
    optional_positive = {
        "trainer.max_steps": cfg.trainer.max_steps,
        "trainer.global_batch_size": cfg.trainer.global_batch_size,
        "trainer.eval_samples": cfg.trainer.eval_samples,
        "trainer.early_stopping_patience": cfg.trainer.early_stopping_patience,
        "trainer.shard_group_size": cfg.trainer.shard_group_size,
        "data.max_bytes": cfg.data.max_bytes,
        "model.hidden_size": cfg.model.hidden_size, "model.num_layers": cfg.model.num_layers,
        "model.num_heads": cfg.model.num_heads, "model.num_kv_heads": cfg.model.num_kv_heads,
        "model.intermediate_size": cfg.model.intermediate_size,
        "model.vocab_size": cfg.model.vocab_size, "model.max_seq_length": cfg.model.max_seq_length,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    for key, value in optional_positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value} must be positive (or null for the default)")
    _check_tensor_parallel(cfg)
    _check_context_parallel(cfg)
    if cfg.trainer.shard_group_size is not None and cfg.trainer.strategy not in ("hsdp", "auto"):
        raise ConfigError(f"trainer.shard_group_size sizes hsdp's shard groups; it does not "
                          f"apply to trainer.strategy={cfg.trainer.strategy} (use hsdp, or "
                          "leave it null)")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout={cfg.model.dropout} must be in [0, 1)")
    if resolve_tokenizer(cfg.data, cfg.model) == "bpe" and cfg.data.vocab_size < 260:
        raise ConfigError(f"data.vocab_size={cfg.data.vocab_size} is too small for a byte-level "
                          "BPE tokenizer (256 bytes + special tokens); use at least 260")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    _check_optim(cfg.optim)
    _check_trainer_knobs(cfg, spec)
    _check_eval_off(cfg.trainer)
    if cfg.checkpoint.every_steps < 0 or cfg.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.every_steps must be >= 0 and checkpoint.keep_last >= 1")
    if cfg.checkpoint.max_failed_saves < 1:
        raise ConfigError(f"checkpoint.max_failed_saves={cfg.checkpoint.max_failed_saves} must "
                          "be >= 1 (1: stop at the first snapshot that cannot be written)")
    d = cfg.distributed
    parse_nnodes(d.nnodes)
    if not 0 <= d.master_port <= 65535:
        raise ConfigError(f"distributed.master_port={d.master_port} must be in 0..65535")
    if not 0 <= d.node_rank < d.max_nodes:
        raise ConfigError(f"distributed.node_rank={d.node_rank} must be in 0..nnodes-1 "
                          f"(nnodes={d.nnodes})")
    if d.elastic and cfg.trainer.global_batch_size is None:
        raise ConfigError(f"distributed.nnodes={d.nnodes} lets the world size change, so the "
                          "global batch must be fixed: set trainer.global_batch_size (a multiple "
                          "of trainer.batch_size x processes for every node count in the range)")
    if d.max_nodes > 1 and d.master_port == 0:
        raise ConfigError("distributed.master_port must be set (the same on every node) when "
                          "distributed.nnodes > 1")
    if d.max_restarts < 0:
        raise ConfigError(f"distributed.max_restarts={d.max_restarts} must be >= 0")
    if cfg.model.arch == "hf":
        p = cfg.model.path
        if not p or not (Path(p).expanduser() / "config.json").is_file() \
                and not Path(p).expanduser().is_file():
            raise ConfigError(f"model.arch=hf needs model.path, a local directory with a "
                              f"config.json or a Hub id as org/name (got {p!r})")
        if Path(p).expanduser().is_dir():
            check_weights(p)
        check_remote_code(cfg)
        if not spec.pretrained:
            check_hf_corpus_tokenizer(cfg)
        _check_pipeline(cfg, spec, None)
        return
    # Model shape checks need the preset applied; presets.py does them (ConfigError too).
    args = resolve_model_config(cfg.model, vocab_size=cfg.model.vocab_size or cfg.data.vocab_size,
                                seq_length=cfg.data.seq_length)
    check_tp_heads(cfg.trainer.tensor_parallel, args.num_heads, args.num_kv_heads,
                   processes=_stated_processes(cfg.trainer.devices))
    _check_pipeline(cfg, spec, args)


def _check_pipeline(cfg: Any, spec: registry.TaskSpec, args: Any) -> None:
    """trainer.pipeline_*: what a pipeline can split and run (`args`: the built-in model's
    shape; None for a Hugging Face model). The processes' side (P divides the world) is checked
    with the devices, in parallel/dims.py."""
    tr = cfg.trainer
    pp = tr.pipeline_parallel
    if pp < 1:
        raise ConfigError(f"trainer.pipeline_parallel={pp} must be >= 1 (1: off)")
    check_choice("trainer.pipeline_schedule", tr.pipeline_schedule, tuple(PIPELINE_SCHEDULES))
    if pp == 1:
        if tr.pipeline_split is not None:
            raise ConfigError("trainer.pipeline_split sizes pipeline stages; set "
                              "trainer.pipeline_parallel > 1 too, or leave it null")
        return
    key = f"trainer.pipeline_parallel={pp}"
    refusals = [
        (args is None or not spec.pipelined, f"{key} splits the built-in llama / gpt models "
         f"(model.arch=llama|gpt) trained on data.format=packed; it cannot split "
         f"{'a Hugging Face model' if args is None else f'data.format={cfg.data.format}'}; "
         "use trainer.pipeline_parallel=1"),
        (tr.strategy in ("dp", "single"), f"{key} runs with data parallelism trainer.strategy="
         f"ddp, fsdp, hsdp or auto over the rest of the processes, not {tr.strategy}"),
        (tr.cpu_offload, f"{key} does not offload to the CPU; set trainer.cpu_offload=false"),
        (tr.compile and tr.pipeline_schedule == "zero-bubble", "trainer.pipeline_schedule="
         "zero-bubble splits each backward in two, which torch does not do for compiled "
         "modules; set trainer.compile=false or another schedule"),
        (tr.pipeline_schedule == "zero-bubble" and (tr.strategy in ("fsdp", "hsdp")
                                                   or tr.tensor_parallel > 1),
         "trainer.pipeline_schedule=zero-bubble runs with ddp inside a stage for now (its split "
         "backward is not verified with FSDP or tensor parallelism); set trainer.strategy=ddp "
         "and trainer.tensor_parallel=1, or another schedule"),
        (tr.precision == "fp16-mixed", f"{key} has no gradient scaler for fp16-mixed; use "
         "trainer.precision=bf16-mixed or fp32"),
        (not cfg.data.drop_last, f"{key} runs full micro-batches only; set data.drop_last=true"),
        (args is not None and args.tie_embeddings, f"{key}: model.tie_embeddings=true shares "
         "the embedding with the output head, which sit on different stages; set "
         "model.tie_embeddings=false"),
    ]
    for refused, line in refusals:
        if refused:
            raise ConfigError(line)
    pipeline_split(args.num_layers, pp, tr.pipeline_schedule, tr.pipeline_split)


def pipeline_split(num_layers: int, pp: int, schedule: str,
                   split: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Blocks per pipeline stage, in stage order (pp x the schedule's stages per process): the
    `trainer.pipeline_split` given, checked, or as even as possible (the first stages take one
    more). A ConfigError when a stage would be empty or the blocks do not add up."""
    stages = pp * PIPELINE_SCHEDULES[schedule]
    per = f"{stages} stages ({pp} processes x {stages // pp} with {schedule})"
    if stages > num_layers:
        raise ConfigError(f"trainer.pipeline_parallel={pp} needs {per}, more than the "
                          f"{num_layers} blocks of the model (model.num_layers); use fewer "
                          "stages or more layers")
    if split is None:
        base, extra = divmod(num_layers, stages)
        return tuple(base + (i < extra) for i in range(stages))
    split = tuple(int(n) for n in split)
    if len(split) != stages:
        raise ConfigError(f"trainer.pipeline_split={list(split)} has "
                          f"{count_of(len(split), 'entry', 'entries')}; "
                          f"the pipeline has {per}: give one block count per stage")
    if min(split) < 1:
        raise ConfigError(f"trainer.pipeline_split={list(split)} leaves stage "
                          f"{split.index(min(split))} empty; every stage needs >= 1 block")
    if sum(split) != num_layers:
        raise ConfigError(f"trainer.pipeline_split={list(split)} adds up to {sum(split)} "
                          f"blocks, but the model has {num_layers} (model.num_layers)")
    return split


def _check_tensor_parallel(cfg: Any) -> None:
    """trainer.tensor_parallel and the `plan.*` target layout (the processes' side is checked
    with the devices, in parallel/dims.py; the heads' with the model's shape)."""
    tr, pl = cfg.trainer, cfg.plan
    if tr.tensor_parallel < 1:
        raise ConfigError(f"trainer.tensor_parallel={tr.tensor_parallel} must be >= 1 (1: off)")
    if tr.tensor_parallel > 1 and tr.strategy == "dp":
        raise ConfigError("trainer.strategy=dp (nn.DataParallel, one process) cannot be combined "
                          f"with trainer.tensor_parallel={tr.tensor_parallel}, which splits layers "
                          "over processes; use trainer.strategy=fsdp or ddp")
    if tr.tensor_parallel > 1 and tr.cpu_offload:
        raise ConfigError("trainer.cpu_offload=true is not supported with "
                          f"trainer.tensor_parallel={tr.tensor_parallel}; set one of them off")
    for key in ("nodes", "devices_per_node", "device_memory_gb"):
        value = getattr(pl, key)
        if value is not None and value <= 0:
            raise ConfigError(f"plan.{key}={value} must be positive (or null: this machine's)")


def _check_context_parallel(cfg: Any) -> None:
    """trainer.context_parallel against what the run holds (the processes' side, that it
    divides the data-parallel ones, is checked with the devices: parallel/dims.py)."""
    tr, cp = cfg.trainer, cfg.trainer.context_parallel
    key = f"trainer.context_parallel={cp}"
    if cp < 1:
        raise ConfigError(f"{key} must be >= 1 (1: off)")
    if cp == 1:
        return
    refusals = (
        (tr.strategy == "dp", "cannot run under trainer.strategy=dp (one process drives every "
         "GPU); use trainer.strategy=ddp or fsdp"),
        (cfg.model.arch == "hf", "splits the built-in llama / gpt only; a Hugging Face model "
         "(model.arch=hf) cannot take it yet: use trainer.context_parallel=1"),
        (cfg.data.format != "packed", f"takes packed windows (data.format=packed), not "
         f"data.format={cfg.data.format}: use data.format=packed or trainer.context_parallel=1"),
        (tr.cpu_offload, "is not supported with trainer.cpu_offload=true; set one of them off"),
        (cfg.data.document_mask, "cannot split windows with data.document_mask=true yet (each "
         "rank would need every document's bounds); set one of them off"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{key} {why}")
    seq = cfg.data.seq_length
    if seq % (2 * cp):
        fits = ", ".join(str(c) for c in range(1, seq // 2 + 1) if seq % (2 * c) == 0
                         and c <= 64)
        raise ConfigError(f"{key} cuts each sequence into 2 x {cp} equal chunks (head-tail "
                          f"balancing), which data.seq_length={seq} is not a multiple of; use "
                          f"a multiple of {2 * cp}, or trainer.context_parallel in {fits}")


def _check_optim(o: Any) -> None:
    """optim.*: the optimizer, the schedule and their numbers (the fix in each line)."""
    check_choice("optim.name", o.name, OPTIMIZERS)
    check_choice("optim.schedule", o.schedule, SCHEDULES)
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr} must be positive")
    if o.min_lr is not None and not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr} (the "
                          f"decay ends there); leave it unset for lr/10 ({o.lr / 10:g}) or pass "
                          "optim.min_lr=0 to decay to zero")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    if o.warmup_steps < 0 or o.weight_decay < 0 or o.grad_clip < 0 or o.momentum < 0:
        raise ConfigError("optim.warmup_steps, optim.weight_decay, optim.grad_clip and "
                          "optim.momentum must be >= 0")
    if o.warmup_ratio is not None and not 0.0 <= o.warmup_ratio < 1.0:
        raise ConfigError(f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1) (a fraction "
                          "of the run's steps), or null to use optim.warmup_steps")
    if o.warmup_start_factor is not None and not 0.0 <= o.warmup_start_factor <= 1.0:
        raise ConfigError(f"optim.warmup_start_factor={o.warmup_start_factor} must be in [0, 1]: "
                          "the warmup starts at lr x this (0: HF Trainer's; 0.1: "
                          "LinearLR(start_factor=0.1)), or null for lr x 1/warmup_steps")
    if not 0.0 < o.decay_ratio <= 1.0:
        raise ConfigError(f"optim.decay_ratio={o.decay_ratio} must be in (0, 1]: the fraction "
                          "of the run's steps that optim.schedule=wsd spends decaying")
    if o.fused and o.name != "adamw":
        raise ConfigError(f"optim.fused applies to optim.name=adamw, not {o.name}; leave it "
                          "null")
    if o.name == "adamw-8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("optim.name=adamw-8bit needs the bitsandbytes package (pip install "
                          "bitsandbytes; it runs on CUDA and on the CPU); optim.name=adafactor is "
                          "the memory-light optimizer that needs nothing more")


def _check_trainer_knobs(cfg: Any, spec: registry.TaskSpec) -> None:
    """trainer.label_smoothing, trainer.neftune_noise_alpha and model.init: where they apply."""
    tr = cfg.trainer
    if not 0.0 <= tr.label_smoothing < 1.0:
        raise ConfigError(f"trainer.label_smoothing={tr.label_smoothing} must be in [0, 1)")
    if tr.neftune_noise_alpha is not None:
        if tr.neftune_noise_alpha < 0:
            raise ConfigError(f"trainer.neftune_noise_alpha={tr.neftune_noise_alpha} must be "
                              ">= 0 (HF's recipes use 5), or null for none")
        if not spec.pretrained:
            raise ConfigError("trainer.neftune_noise_alpha adds noise to a pretrained model's "
                              "input embeddings while fine-tuning it: use it with data.format="
                              + one_of(registry.names(pretrained=True)))
    check_choice("model.init", cfg.model.init, INITS)
    if cfg.model.init != "gpt2" and cfg.model.arch == "hf":
        raise ConfigError("model.init sets how our llama / gpt models start; a Hugging Face "
                          "model (model.arch=hf) loads its weights, or its own init without "
                          "them: leave model.init unset")


def _check_eval_off(tr: Any) -> None:
    """trainer.eval_every=0 switches evaluation off: what needs evaluations is refused with it."""
    if tr.eval_every < 0:
        raise ConfigError(f"trainer.eval_every={tr.eval_every} must be >= 0 (0: no evaluation)")
    needs = [k for k, on in (("trainer.early_stopping_patience",
                              tr.early_stopping_patience is not None),
                             ("trainer.keep_best", tr.keep_best)) if on]
    if tr.eval_every == 0 and needs:
        raise ConfigError(f"trainer.eval_every=0 switches evaluation off, but {needs[0]} needs "
                          "evaluations: set trainer.eval_every=N or leave it unset")


def _stated_processes(devices: Any) -> Optional[int]:
    """The processes per node trainer.devices states without asking torch (cpu:N, gpu:N, a
    list of GPUs); None for auto and the like."""
    text = str(devices)
    if text[:4] in ("cpu:", "gpu:") and text[4:].isdigit():
        return int(text[4:])
    return len(devices) if isinstance(devices, (list, tuple)) or \
        type(devices).__name__ == "ListConfig" else None


def attention_heads(cfg: Any) -> tuple[int, ...]:
    """The model's attention and key/value head counts, where its config says them (tensor
    parallelism must divide both); () when it does not."""
    if cfg.model.arch == "hf":
        info = model_config(cfg.model.path)
        heads = info.get("num_attention_heads")
        counts = (heads, info.get("num_key_value_heads") or heads)
    elif cfg.model.arch in ("llama", "gpt"):
        args = resolve_model_config(cfg.model, seq_length=cfg.data.seq_length,
                                    vocab_size=cfg.model.vocab_size or cfg.data.vocab_size)
        counts = (args.num_heads, args.num_kv_heads)
    else:
        return ()
    return tuple(c for c in counts if isinstance(c, int) and c > 0)


def check_tp_heads(tp: int, heads: Optional[int], kv_heads: Optional[int],
                   names: tuple[str, str] = ("model.num_heads", "model.num_kv_heads"),
                   processes: Optional[int] = None) -> None:
    """Under tensor parallelism each rank computes whole attention heads (and whole key/value
    heads): `trainer.tensor_parallel` must divide both counts (`names`: what the message calls
    them). `processes`: a node's, when the config states them; the values suggested divide it
    too (parallel/dims.py checks that side)."""
    if tp <= 1:
        return
    for name, count in zip(names, (heads, kv_heads)):
        if count is not None and count % tp:
            fits = [d for d in range(1, count + 1) if count % d == 0 and
                    (heads is None or heads % d == 0) and (kv_heads is None or kv_heads % d == 0)
                    and (processes is None or processes % d == 0)]
            raise ConfigError(f"trainer.tensor_parallel={tp} does not divide {name}={count} "
                              f"(each rank computes whole heads); use one of "
                              f"{', '.join(map(str, fits))}")
