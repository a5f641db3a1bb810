"""Models: shapes, causality, padding, GQA, tying, RoPE, presets, generation, a few steps."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from paratrain.config import ModelConfig
from paratrain.errors import ConfigError
from paratrain.models import (
    PRESETS,
    ModelArgs,
    build_model,
    count_params,
    flops_per_token,
    generate,
    resolve_model_config,
)
from paratrain.models.llama import Rotary

ARCHS = ["llama", "gpt"]
V, T = 97, 16


def tiny(arch: str = "llama", **kw) -> ModelArgs:
    return resolve_model_config(ModelConfig(arch=arch, preset="tiny", **kw), vocab_size=V,
                                seq_length=32)


def model(arch: str = "llama", seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(tiny(arch, **kw)).eval()


def tokens(B: int = 2, T: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- forward -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_shape_and_interface(arch):
    m = model(arch)
    out = m(tokens(3, 11))
    assert out.shape == (3, 11, V) and out.dtype == torch.float32
    assert len(m.layers) == 2 and all(isinstance(b, m.block_class) for b in m.layers)
    assert m.args.max_seq_length == 32


@pytest.mark.parametrize("arch", ARCHS)
def test_longer_than_max_seq_length_is_an_error(arch):
    with pytest.raises(ValueError, match="max_seq_length=32"):
        model(arch)(tokens(1, 33))


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_future_tokens_do_not_change_past_logits(arch):
    m, x = model(arch), tokens(2, T)
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 1) % V
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-5, rtol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("arch", ARCHS)
def test_right_padding_matches_unpadded(arch):
    m = model(arch)
    x = tokens(2, T)
    n = [T, 10]  # row 1 holds 10 real tokens then pads
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, k in enumerate(n):
        mask[i, :k] = 1
    padded = x.clone()
    padded[1, 10:] = 0
    out = m(padded, attention_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], m(x[:1])[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1, :10], m(x[1:2, :10])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_and_all_pad_rows_give_no_nan(arch):
    m = model(arch).train()  # dropout off in tiny, but exercise the training path too
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[0, :5] = False  # left padding: pad queries have no real key before them
    mask[1, :] = False  # a row that is all padding
    out = m(tokens(3, T), attention_mask=mask)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_llama_left_padding_matches_unpadded_thanks_to_rope():
    """RoPE only sees distances, so shifting a sequence right by pads changes nothing."""
    m, x = model("llama"), tokens(1, 10)
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(1, 6), torch.ones(1, 10)], dim=1)
    torch.testing.assert_close(m(padded, mask)[:, 6:], m(x), atol=1e-5, rtol=0)


# ---- structure -----------------------------------------------------------------------------
def test_gqa_has_fewer_params_than_mha():
    gqa, mha = tiny(num_kv_heads=1), tiny(num_kv_heads=4)
    assert gqa.num_kv_heads == 1 and mha.num_kv_heads == 4
    saved = count_params(build_model(mha)) - count_params(build_model(gqa))
    # wk and wv shrink from 4 heads to 1 in both layers
    assert saved == 2 * 2 * 64 * (64 - 16)
    assert build_model(gqa)(tokens()).shape == (2, T, V)


@pytest.mark.parametrize("arch", ARCHS)
def test_tied_head_shares_storage_and_untied_does_not(arch):
    tied, untied = model(arch, tie_embeddings=True), model(arch, tie_embeddings=False)
    emb = [p for n, p in tied.named_parameters() if p.dim() == 2][0]  # the token embedding
    assert tied.lm_head.weight.data_ptr() == emb.data_ptr()
    assert count_params(untied) - count_params(tied) == V * 64
    emb_u = untied.tok_embeddings if arch == "llama" else untied.wte
    assert untied.lm_head.weight.data_ptr() != emb_u.weight.data_ptr()


def test_tie_defaults_per_arch():
    assert tiny("gpt").tie_embeddings is True
    assert tiny("llama").tie_embeddings is False


def test_residual_projections_get_the_scaled_init():
    torch.manual_seed(0)
    args = resolve_model_config(ModelConfig(preset="small"), 4096, 256)
    m = build_model(args)
    std_wq = m.layers[0].attention.wq.weight.std().item()
    std_wo = m.layers[0].attention.wo.weight.std().item()
    assert abs(std_wq - 0.02) < 1e-3
    assert abs(std_wo - 0.02 / math.sqrt(2 * 6)) < 1e-3


# ---- RoPE ----------------------------------------------------------------------------------
def test_rope_scores_depend_only_on_relative_position():
    rope = Rotary(head_dim=8, max_seq_length=32, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i: int, j: int) -> torch.Tensor:
        x = torch.zeros(1, 1, 32, 8)
        y = torch.zeros(1, 1, 32, 8)
        x[0, 0, i], y[0, 0, j] = q, k
        return rope(x)[0, 0, i] @ rope(y)[0, 0, j]

    torch.testing.assert_close(score(5, 2), score(20, 17), atol=1e-5, rtol=0)
    assert not torch.allclose(score(5, 2), score(5, 3))
    # position 0 is the identity, and rotation keeps the norm
    x = torch.randn(1, 2, 32, 8)
    torch.testing.assert_close(rope(x)[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(rope(x).norm(dim=-1), x.norm(dim=-1))


def test_rope_matches_complex_reference():
    """Meta's formulation: pairs of channels as complex numbers times exp(i * pos * freq)."""
    D, theta = 8, 500.0
    rope = Rotary(D, 16, theta)
    x = torch.randn(2, 3, 16, D)
    freqs = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    cis = torch.polar(torch.ones(16, D // 2), torch.outer(torch.arange(16).float(), freqs))
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, 16, D // 2, 2)) * cis)
    torch.testing.assert_close(rope(x), ref.flatten(-2), atol=1e-5, rtol=0)


def test_rope_tables_stay_fp32_and_survive_meta_init():
    m = model("llama").to(torch.bfloat16)
    assert m.layers[0].attention.rotary.cos.dtype == torch.float32
    ref = model("llama")
    with torch.device("meta"):
        meta = build_model(ref.args)
    meta.to_empty(device="cpu")
    meta.load_state_dict(ref.state_dict())  # non-persistent tables are not in the state dict
    torch.testing.assert_close(meta(tokens()), ref(tokens()))


# ---- presets and config resolution ---------------------------------------------------------
def test_explicit_fields_win_over_preset_and_vocab_from_argument():
    a = resolve_model_config(ModelConfig(preset="small", num_layers=3), vocab_size=500,
                             seq_length=128)
    assert (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads) == (256, 3, 8, 4)
    assert a.vocab_size == 500 and a.max_seq_length == 128
    assert a.intermediate_size == 704  # ceil64(int(8 * 256 / 3))
    b = resolve_model_config(ModelConfig(preset="small", vocab_size=512, max_seq_length=1024,
                                         intermediate_size=100), 500, 128)
    assert (b.vocab_size, b.max_seq_length, b.intermediate_size) == (512, 1024, 100)
    g = resolve_model_config(ModelConfig(arch="gpt", preset="small"), 500, 128)
    assert g.num_kv_heads == g.num_heads == 8 and g.intermediate_size == 1024


def test_no_preset_needs_every_size():
    a = resolve_model_config(ModelConfig(preset=None, hidden_size=32, num_layers=1,
                                         num_heads=2), 50, 8)
    assert a.num_kv_heads == 2 and a.intermediate_size == 128
    with pytest.raises(ConfigError, match=r"model\.num_layers is not set"):
        resolve_model_config(ModelConfig(preset=None, hidden_size=32, num_heads=2), 50, 8)


@pytest.mark.parametrize("overrides, pattern", [
    (dict(num_heads=5), r"^model\.num_heads=5 does not divide model\.hidden_size=64; "
                        r"pick a divisor of 64 such as 4 or 8$"),
    (dict(num_kv_heads=3), r"^model\.num_kv_heads=3 does not divide model\.num_heads=4; "
                           r"pick a divisor of 4 such as 2 or 4$"),
    (dict(hidden_size=50), r"^model\.num_heads=4 does not divide model\.hidden_size=50; .*"
                           r"\(model\.num_heads comes from preset 'tiny'\)$"),
    (dict(hidden_size=60, num_heads=3), r"^model\.num_kv_heads=2 does not divide model\."
                                        r"num_heads=3; pick a divisor of 3 such as 1 or 3 "
                                        r"\(model\.num_kv_heads comes from preset 'tiny'\)$"),
    (dict(hidden_size=60, num_heads=4, num_kv_heads=4), r"head_dim=15.*even"),
    (dict(preset="huge"), r"model\.preset='huge'.*tiny, small, medium, base, large"),
    (dict(arch="bert"), r"model\.arch='bert' is not one of: llama, gpt"),
    (dict(arch="gpt", num_kv_heads=2), r"model\.num_kv_heads=2 is not supported with "
                                       r"model\.arch='gpt'"),
    (dict(max_seq_length=16), r"model\.max_seq_length=16 is shorter than data\.seq_length=32"),
])
def test_bad_shapes_raise_one_line_config_errors(overrides, pattern):
    kw = dict(preset="tiny")
    kw.update(overrides)
    with pytest.raises(ConfigError, match=pattern) as e:
        resolve_model_config(ModelConfig(**kw), vocab_size=V, seq_length=32)
    assert "\n" not in str(e.value)


def test_gpt_head_dim_may_be_odd():
    a = resolve_model_config(ModelConfig(arch="gpt", preset=None, hidden_size=60, num_layers=1,
                                         num_heads=4), V, 8)
    assert build_model(a)(tokens(1, 8)).shape == (1, 8, V)


def test_args_roundtrip_through_json():
    a = tiny("gpt", dropout=0.1)
    b = ModelArgs.from_dict(json.loads(json.dumps(a.to_dict())))
    assert a == b and b.head_dim == 16
    with pytest.raises(ConfigError, match="unknown key"):
        ModelArgs.from_dict({**a.to_dict(), "n_embd": 3})
    with pytest.raises(ConfigError, match="missing key.*vocab_size"):
        ModelArgs.from_dict({k: v for k, v in a.to_dict().items() if k != "vocab_size"})


@pytest.mark.parametrize("name, vocab, lo, hi", [
    ("small", 4096, 4e6, 9e6), ("medium", 4096, 14e6, 20e6), ("base", 32000, 100e6, 140e6),
    ("large", 32000, 300e6, 400e6), ("1b", 32000, 0.8e9, 1.2e9),
])
@pytest.mark.parametrize("arch", ARCHS)
def test_preset_param_counts(arch, name, vocab, lo, hi):
    args = resolve_model_config(ModelConfig(arch=arch, preset=name), vocab, 256)
    with torch.device("meta"):  # no memory, no init time
        n = count_params(build_model(args))
    assert lo <= n <= hi, n


def test_presets_are_valid_for_both_archs():
    assert {"tiny", "small", "medium", "base", "large"} <= set(PRESETS)
    for name in PRESETS:
        for arch in ARCHS:
            resolve_model_config(ModelConfig(arch=arch, preset=name), 4096, 256)


def test_flops_per_token_matches_6n_plus_attention():
    args = resolve_model_config(ModelConfig(preset="small"), 4096, 256)
    m = build_model(args)
    n_matmul = count_params(m) - 4096 * 256 - sum(p.numel() for p in m.parameters() if p.dim() == 1)
    assert flops_per_token(args, 256) == 6 * n_matmul + 12 * 6 * 8 * 32 * 256


# ---- generation ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_length_and_greedy_determinism(arch):
    m = model(arch)
    prompt = tokens(2, 5)
    a = generate(m, prompt, max_new_tokens=40, temperature=0.0)  # crosses max_seq_length=32
    b = generate(m, prompt, max_new_tokens=40, temperature=0.0)
    assert a.shape == (2, 45) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    s1 = generate(m, prompt, 10, temperature=1.0, top_k=5, generator=g())
    s2 = generate(m, prompt, 10, temperature=1.0, top_k=5, generator=g())
    assert torch.equal(s1, s2) and s1.shape == (2, 15) and s1.max() < V


def test_generate_top_k_1_is_greedy_and_mode_is_restored():
    m = model("llama").train()
    prompt = tokens(1, 4)
    greedy = generate(m, prompt, 6, temperature=0.0)
    assert torch.equal(generate(m, prompt, 6, temperature=0.7, top_k=1), greedy)
    assert m.training


def test_generate_stops_early_at_eos():
    m, prompt = model("llama"), tokens(2, 3)
    greedy = generate(m, prompt, 20, temperature=0.0)
    eos = int(greedy[0, 3])  # the first token row 0 generates
    out = generate(m, prompt, 20, temperature=0.0, eos_id=eos)
    if (greedy[1, 3:] == eos).any():  # row 1 also reaches eos: stop at its first eos
        stop = int((greedy[1, 3:] == eos).nonzero()[0]) + 4
        assert out.shape[1] == stop
    else:
        assert out.shape == greedy.shape
    assert (out[0, 3:] == eos).all()  # a finished row keeps receiving eos
    out1 = generate(m, prompt[:1], 20, temperature=0.0, eos_id=eos)
    assert out1.shape == (1, 4)


# ---- training ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_a_few_adamw_steps_lower_the_loss(arch):
    m = model(arch).train()
    x = tokens(4, 17)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        logits = m(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(V), rel=0.1)  # init predicts ~uniform
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("with_mask", [False, True])
def test_activation_checkpointing_gives_same_output_and_grads(arch, with_mask):
    block = model(arch).train().layers[0]
    x = torch.randn(2, T, 64, requires_grad=True)
    mask = None
    if with_mask:
        from paratrain.models.llama import padding_to_attn_mask
        mask = padding_to_attn_mask(torch.tensor([[1] * T, [1] * 9 + [0] * (T - 9)]))
    plain = block(x, mask)
    plain.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    ckpt = checkpoint(block, x, mask, use_reentrant=False)
    ckpt.square().sum().backward()
    torch.testing.assert_close(ckpt, plain)
    for a, b in zip(grads, [p.grad for p in block.parameters()] + [x.grad]):
        torch.testing.assert_close(a, b)


def test_models_package_and_presets_do_not_import_torch():
    """Model sizes and FLOPs are read without torch: a millisecond, not a second."""
    import subprocess
    import sys
    from pathlib import Path

    import paratrain
    pkg_dir = str(Path(paratrain.__file__).parent)
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('paratrain'); pkg.__path__ = [{pkg_dir!r}]\n"
        "sys.modules['paratrain'] = pkg  # skip paratrain/__init__, which imports the trainer\n"
        "import paratrain.models as m\n"
        "from paratrain.models import resolve_model_config, flops_per_token, generate\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_dropout_only_in_training(arch):
    m, x = model(arch, dropout=0.2), tokens()
    mask = torch.ones_like(x)
    torch.testing.assert_close(m(x), m(x))  # eval: deterministic
    m.train()
    assert not torch.allclose(m(x), m(x))
    assert torch.isfinite(m(x, mask)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_weights_run_and_stay_close(arch):
    m, x = model(arch), tokens()
    ref = m(x)
    out = m.to(torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05
