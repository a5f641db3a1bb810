"""`paratrain plan` at scale without processes: the real parallelized model on the meta device
in torch's fake process group. Per-device parameter bytes must be exactly what each tensor's
split gives (TP's chunk, then FSDP's chunk of it, rank 0 taking the remainder), the layouts come
in auto's order with the asked one marked, and the figures move the way the layouts say."""

from __future__ import annotations

import math

import pytest

from paratrain import TrainConfig
from paratrain.models import resolve_model_config
from paratrain.parallel.simulate import simulate_at_scale

# how our Llama plan splits each parameter (parallel/tensor.py): dim split over tp, or None
COLUMNS = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "lm_head.weight",
           "tok_embeddings.weight")
ROWS = ("wo.weight", "w2.weight")


def analytic_rank0_elements(args, tp: int, dp_shard: int) -> tuple[int, int]:
    """(elements, tensors) rank 0 holds: per tensor, TP's first chunk along its split dim, then
    FSDP's first chunk of that along dim 0 (chunks of ceil(n / parts), as torch.chunk)."""
    C, kv, inter, V = args.hidden_size, args.num_kv_heads * args.head_dim, \
        args.intermediate_size, args.vocab_size
    block = {"attention.wq.weight": (C, C), "attention.wk.weight": (kv, C),
             "attention.wv.weight": (kv, C), "attention.wo.weight": (C, C),
             "feed_forward.w1.weight": (inter, C), "feed_forward.w3.weight": (inter, C),
             "feed_forward.w2.weight": (C, inter), "attention_norm.weight": (C,),
             "ffn_norm.weight": (C,)}
    shapes = {"tok_embeddings.weight": (V, C), "norm.weight": (C,), "lm_head.weight": (V, C)}
    for i in range(args.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in block.items()})

    def first(n: int, parts: int) -> int:
        return math.ceil(n / parts)
    total = 0
    for name, shape in shapes.items():
        shape = list(shape)
        if name.endswith(COLUMNS):
            shape[0] = first(shape[0], tp)
        elif name.endswith(ROWS):
            shape[1] = first(shape[1], tp)
        shape[0] = first(shape[0], dp_shard)
        total += math.prod(shape)
    return total, len(shapes)


def _plan(*overrides):
    cfg = TrainConfig.from_yaml(None, list(overrides))
    rows, target, pick, work = simulate_at_scale(cfg)
    args = resolve_model_config(cfg.model, vocab_size=cfg.data.vocab_size,
                                seq_length=cfg.data.seq_length)
    return rows, (target, work), pick, args


@pytest.mark.parametrize("preset, nodes, per_node, tp", [
    ("tiny", 1, 4, 2),  # the 4-process layout the real-process test runs
    pytest.param("llama3-8b", 16, 8, 8, marks=pytest.mark.slow),  # uneven: 128256 / 8 / 16
])
def test_parameter_bytes_per_device_are_exactly_each_tensors_split(preset, nodes, per_node, tp):
    rows, (target, _), _, args = _plan(f"model.preset={preset}", f"plan.nodes={nodes}",
                                       f"plan.devices_per_node={per_node}",
                                       f"trainer.tensor_parallel={tp}", "trainer.strategy=fsdp",
                                       "data.seq_length=32", "trainer.batch_size=1",
                                       "plan.device_memory_gb=80")
    [asked] = [r for r in rows if r.asked]
    assert asked.label == f"fsdp+tp{tp}"
    assert asked.dims == f"dp_shard={target.world // tp} x tp={tp}"
    elements, tensors = analytic_rank0_elements(args, tp, target.world // tp)
    assert asked.params_bytes == 4 * elements  # fp32
    assert asked.grads_bytes == asked.params_bytes
    assert asked.optimizer_bytes == 2 * asked.params_bytes + 4 * tensors  # AdamW: 2 moments, step
    [fsdp] = [r for r in rows if r.label == "fsdp"]
    assert fsdp.params_bytes == 4 * analytic_rank0_elements(args, 1, target.world)[0]


@pytest.mark.slow
def test_layouts_come_in_autos_order_and_the_figures_move_as_the_layouts_say():
    rows, (target, work), pick, _ = _plan(
        "model.preset=llama3-8b", "plan.nodes=4", "plan.devices_per_node=8",
        "plan.device_memory_gb=80", "trainer.precision=bf16-mixed", "trainer.batch_size=1",
        "data.seq_length=4096")
    labels = [r.label for r in rows]
    assert labels == ["ddp", "hsdp", "fsdp", "fsdp+tp2", "fsdp+tp4", "fsdp+tp8", "fsdp+ac",
                      "fsdp+tp2+ac", "fsdp+tp4+ac", "fsdp+tp8+ac", "fsdp+offload"]
    by = {r.label: r for r in rows}
    assert by["ddp"].asked  # strategy auto, tensor_parallel 1: what train would start with
    # sequence parallelism splits the activations too; recomputing keeps only block inputs
    assert by["fsdp+tp2"].activation_bytes < by["fsdp"].activation_bytes
    assert by["fsdp+tp8"].activation_bytes < by["fsdp+tp4"].activation_bytes
    assert by["fsdp+ac"].activation_bytes < by["fsdp"].activation_bytes / 4
    # the tensor-parallel collectives are those the meta forward and backward issued
    assert set(by["fsdp+tp8"].sent) == {"dp_shard", "tp"}
    assert set(by["fsdp+tp8"].sent["tp"]) == {"all-gather", "reduce-scatter"}
    assert set(by["hsdp"].sent) == {"dp_shard", "dp_replicate"}
    assert set(by["ddp"].sent) == {"dp_replicate"}
    # auto: the first layout, in this order, that fits in 80% of the device, as `train`'s auto
    # takes it: tensor parallelism only when asked for (then the keys that ask for it)
    first = next(r for r in rows if r.device_bytes <= 0.8 * 80e9 and "tp" not in r.label)
    assert pick.label == first.label
    from paratrain.parallel.memory_estimate import layout_keys
    from paratrain.parallel.simulate import format_simulation
    text = format_simulation(rows, target, pick, work, "llama3-8b")
    assert f"trainer.strategy=auto picks {pick.label} " in text and layout_keys(pick) in text
    assert layout_keys(pick).startswith("trainer.strategy=")
