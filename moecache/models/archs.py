"""The architectures tiny_moe builds (moecache.models.tiny): one function per GGUF architecture
name, registered with @architecture, that writes a tiny random model of it through a TinyModel:
its metadata (moe_hparams first, then the architecture's own keys, then the tokenizer), then every
tensor its llama.cpp loader requires, with the routed experts exactly as the architecture stores
them (biases, fused gate_up, per-expert scales, shared experts, selection biases), so that each
variant of the expert FFN has a model the cache's exactness tests run on (tests/test_archs.py).
Each builder's docstring names the real models it stands for and the variant it exercises."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .tiny import TinyModel, architecture

SIGMOID, SQRT_SOFTPLUS = 2, 4  # expert_gating_func values (llama_expert_gating_func_type)
# a sliding window shorter than prompt + decoded tokens, so the windowed layers really slide
TINY_SLIDING_WINDOW = 16
HC_MULT = 4  # the mHC residual streams (DeepSeek-V4, GLM-5): the loaders support only 4
# gated delta net (linear attention) shape: like the real models, 2 value heads share each key head
_GDN_K_HEADS, _GDN_V_HEADS, _GDN_CONV_KERNEL = 2, 4, 4
# the real models put one full attention layer after 3 linear ones; 2 gives the tiny one of each
_FULL_ATTENTION_INTERVAL = 2


def _gated_ffn(m: TinyModel, i: int, suffix: str, n_ff: int) -> None:
    """A dense gate/up/down FFN of layer i (ffn_gate{suffix}, ...): a shared expert or a
    shared MLP."""
    p = f"blk.{i}."
    m.weight(f"{p}ffn_gate{suffix}.weight", n_ff, m.n_embd)
    m.weight(f"{p}ffn_up{suffix}.weight", n_ff, m.n_embd)
    m.weight(f"{p}ffn_down{suffix}.weight", m.n_embd, n_ff)



# --- llama-style attention: qwen3moe, granitemoe, Mixtral, Qwen2-MoE, OLMoE, ERNIE, Hunyuan,
# MiniMax-M2, GLM-4.5 ---------------------------------------------------------------------------

@architecture("qwen3moe")
def _qwen3moe(m: TinyModel) -> None:
    m.moe_hparams()
    m.head()
    for i in range(m.n_layer):
        m.moe_block(i, q_k_norms=True)


@architecture("granitemoe")
def _granitemoe(m: TinyModel) -> None:
    m.moe_hparams(n_ff=m.n_ff)  # its loader sizes the experts by feed_forward_length
    m.w.add_logit_scale(1.0)    # required; the other granite scales are optional
    m.head()
    for i in range(m.n_layer):
        m.moe_block(i)


def _qkv_biases(m: TinyModel, i: int) -> None:
    """Layer i's attention q, k and v biases (the qwen2 and GLM attention)."""
    p, d = f"blk.{i}.", m.head_dim
    m.weight(p + "attn_q.bias", m.n_head * d, std=0.1)
    m.weight(p + "attn_k.bias", m.n_head_kv * d, std=0.1)
    m.weight(p + "attn_v.bias", m.n_head_kv * d, std=0.1)


def _expert_probs_bias(m: TinyModel, i: int, std: float = 0.05) -> None:
    """Layer i's expert selection bias (e_score_correction_bias): added to the router's
    probabilities to choose the experts, not to their weights."""
    m.weight(f"blk.{i}.exp_probs_b.bias", m.n_expert, std=std)


@architecture("llama")
def _llama(m: TinyModel) -> None:
    """Mixtral-8x7B/8x22B: arch llama with experts; SwiGLU experts, softmax gating, top-k
    weights renormalized, no shared expert."""
    m.moe_hparams(n_ff=m.n_ff)  # its loader sizes the experts by feed_forward_length
    m.head()
    for i in range(m.n_layer):
        m.moe_block(i)


@architecture("qwen2moe")
def _qwen2moe(m: TinyModel) -> None:
    """Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B: SwiGLU experts, softmax gating without
    renormalization, plus a shared expert scaled by its own sigmoid gate (ffn_gate_inp_shexp)."""
    m.moe_hparams()
    m.kv("expert_shared_feed_forward_length", 4 * m.n_ff)  # 4x an expert, as in the real ones
    m.head()
    for i in range(m.n_layer):
        m.attention(i)
        _qkv_biases(m, i)
        m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.router(i)
        m.routed_experts(i)
        m.weight(f"blk.{i}.ffn_gate_inp_shexp.weight", m.n_embd)
        _gated_ffn(m, i, "_shexp", 4 * m.n_ff)


@architecture("olmoe")
def _olmoe(m: TinyModel) -> None:
    """OLMoE-1B-7B: SwiGLU experts, softmax gating without renormalization, no shared expert."""
    # its q and k norms span all heads ({n_embd}), so k must be as wide as q: no GQA
    m.n_head_kv = m.n_head
    m.moe_hparams(n_ff=m.n_ff)  # its loader sizes the experts by feed_forward_length
    m.head()
    for i in range(m.n_layer):
        m.attention(i)
        m.ones(f"blk.{i}.attn_q_norm.weight", m.n_embd)
        m.ones(f"blk.{i}.attn_k_norm.weight", m.n_embd)
        m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.router(i)
        m.routed_experts(i)


@architecture("ernie4_5-moe")
def _ernie4_5_moe(m: TinyModel) -> None:
    """ERNIE-4.5-21B-A3B/300B-A47B: SwiGLU experts, softmax gating renormalized, expert selection
    bias (exp_probs_b) and two shared experts (one FFN twice an expert's width)."""
    m.moe_hparams()
    m.kv("expert_shared_count", 2)
    m.kv("expert_shared_feed_forward_length", 2 * m.n_ff)
    m.kv("interleave_moe_layer_step", 1)
    m.kv("leading_dense_block_count", 0)  # the real ones start with a dense layer
    m.head()
    for i in range(m.n_layer):
        m.attention(i)
        m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.router(i)
        _expert_probs_bias(m, i)
        m.routed_experts(i)
        _gated_ffn(m, i, "_shexp", 2 * m.n_ff)


@architecture("hunyuan-moe")
def _hunyuan_moe(m: TinyModel) -> None:
    """Hunyuan-A13B: SwiGLU experts, softmax gating renormalized, plus an ungated shared expert
    of an expert's width."""
    m.moe_hparams(n_ff=m.n_ff)  # its loader sizes the experts by feed_forward_length
    m.kv("expert_shared_feed_forward_length", m.n_ff)
    m.head()
    for i in range(m.n_layer):
        m.moe_block(i, q_k_norms=True)
        _gated_ffn(m, i, "_shexp", m.n_ff)


@architecture("minimax-m2")
def _minimax_m2(m: TinyModel) -> None:
    """MiniMax-M2: SwiGLU experts, sigmoid gating renormalized with an expert selection bias
    (exp_probs_b), no shared expert."""
    m.moe_hparams(n_ff=m.n_ff)  # its loader sizes the experts by feed_forward_length
    m.kv("expert_gating_func", SIGMOID)
    m.head()
    for i in range(m.n_layer):
        m.attention(i)
        # its q and k norms span all heads of each
        m.ones(f"blk.{i}.attn_q_norm.weight", m.n_head * m.head_dim)
        m.ones(f"blk.{i}.attn_k_norm.weight", m.n_head_kv * m.head_dim)
        m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.router(i)
        m.routed_experts(i)
        _expert_probs_bias(m, i)


@architecture("glm4moe")
def _glm4moe(m: TinyModel) -> None:
    """GLM-4.5 (355B-A32B): SwiGLU experts, sigmoid gating with an expert selection bias
    (exp_probs_b), renormalized and scaled by 2.5, plus one shared expert."""
    m.moe_hparams()
    m.kv("expert_shared_count", 1)
    m.kv("leading_dense_block_count", 0)  # the real ones start with dense layers
    m.kv("expert_weights_scale", 2.5)
    m.kv("expert_weights_norm", True)
    m.kv("expert_gating_func", SIGMOID)
    m.head()
    for i in range(m.n_layer):
        m.attention(i, q_k_norms=True)
        _qkv_biases(m, i)
        # its FFN input norm is named post_attention_norm
        m.ones(f"blk.{i}.post_attention_norm.weight", m.n_embd)
        m.router(i)
        _expert_probs_bias(m, i)
        m.routed_experts(i)
        _gated_ffn(m, i, "_shexp", m.n_ff)


# --- gpt-oss, Llama 4, Gemma 4 -------------------------------------------------------------------

@architecture("gpt-oss")
def _gpt_oss(m: TinyModel) -> None:
    """gpt-oss-20b/120b: SwiGLU-OAI experts with biases on gate, up and down, a router with a
    bias, softmax over the selected experts; attention sinks, every other layer windowed."""
    m.moe_hparams()
    m.kv("attention.sliding_window", TINY_SLIDING_WINDOW)  # even layers windowed, odd full
    m.head()
    e, f, d = m.n_expert, m.n_ff, m.n_embd
    for i in range(m.n_layer):
        p = f"blk.{i}."
        m.attention(i)
        for proj, n_out in (("q", m.n_head), ("k", m.n_head_kv), ("v", m.n_head_kv)):
            m.weight(f"{p}attn_{proj}.bias", n_out * m.head_dim, std=0.1)
        m.weight(p + "attn_output.bias", d, std=0.1)
        m.weight(p + "attn_sinks.weight", m.n_head, std=1.0)
        m.ones(p + "post_attention_norm.weight", d)
        m.router(i)
        m.weight(p + "ffn_gate_inp.bias", e, std=0.1)
        m.routed_experts(i)
        m.weight(p + "ffn_gate_exps.bias", e, f, std=0.1)
        m.weight(p + "ffn_up_exps.bias", e, f, std=0.1)
        m.weight(p + "ffn_down_exps.bias", e, d, std=0.1)


@architecture("llama4")
def _llama4(m: TinyModel) -> None:
    """Llama-4-Scout/Maverick: SiLU experts, sigmoid gating whose weights scale each expert's
    input (before the FFN), plus an always-on shared expert."""
    # every 4th layer is a global NoPE layer with attention temperature tuning; with fewer
    # than 4 layers llama.cpp builds that temperature input but no layer uses it (it aborts)
    m.n_layer = max(m.n_layer, 4)
    m.moe_hparams()
    m.kv("interleave_moe_layer_step", 1)  # every layer MoE, as in Scout
    m.head()
    for i in range(m.n_layer):
        m.moe_block(i)
        _gated_ffn(m, i, "_shexp", m.n_ff)  # the loader sizes the shared expert as one expert


def _gemma4_metadata(m: TinyModel) -> None:
    """Gemma 4 hyperparameters: even layers windowed, odd layers global (full attention)."""
    m.moe_hparams()
    m.kv("attention.sliding_window", TINY_SLIDING_WINDOW)
    m.kv("attention.sliding_window_pattern", [i % 2 == 0 for i in range(m.n_layer)])
    m.kv("attention.key_length_swa", m.head_dim)
    m.kv("attention.value_length_swa", m.head_dim)
    m.kv("attention.shared_kv_layers", 0)
    m.kv("embedding_length_per_layer_input", 0)  # no per-layer embeddings, as in 26B-A4B
    m.kv("rope.freq_base_swa", 10_000.0)
    m.kv("final_logit_softcapping", 30.0)


@architecture("gemma4")
def _gemma4(m: TinyModel) -> None:
    """gemma-4-26B-A4B: GELU experts with gate and up fused and a per-expert output scale,
    routed by logits the layer computes itself (scaled RMS norm), softmax and normalized
    top-k weights, beside a dense GELU MLP; sandwich norms around both."""
    _gemma4_metadata(m)
    m.head()
    # proportional rope of the global layers: a quarter of the dimensions rotate, the rest
    # get a huge frequency factor (no rotation)
    n_rot = m.head_dim // 8
    m.tensor("rope_freqs.weight",
             np.array([1.0] * n_rot + [1e30] * (m.head_dim // 2 - n_rot), dtype=np.float32))
    for i in range(m.n_layer):
        p = f"blk.{i}."
        m.attention(i, q_k_norms=True)
        m.ones(p + "post_attention_norm.weight", m.n_embd)
        m.tensor(p + "layer_output_scale.weight", np.array([0.8], dtype=np.float32))
        m.ones(p + "ffn_norm.weight", m.n_embd)
        _gated_ffn(m, i, "", m.n_ff * m.n_expert_used)  # feed_forward_length
        m.ones(p + "post_ffw_norm.weight", m.n_embd)
        m.ones(p + "post_ffw_norm_1.weight", m.n_embd)
        m.ones(p + "pre_ffw_norm_2.weight", m.n_embd)
        m.ones(p + "post_ffw_norm_2.weight", m.n_embd)
        # the router sees rms_norm(x) / sqrt(n_embd) * scale: std 2 makes logits ~ N(0, 2^2)
        m.weight(p + "ffn_gate_inp.weight", m.n_expert, m.n_embd, std=2.0)
        m.ones(p + "ffn_gate_inp.scale", m.n_embd)
        m.routed_experts(i, gate_up=True)
        m.tensor(p + "ffn_down_exps.scale", m.rng.uniform(0.5, 1.5, m.n_expert).astype(np.float32))


# --- Qwen3-Next and Qwen3.5: hybrid gated delta net ----------------------------------------------

def _hybrid_hparams(m: TinyModel) -> None:
    """Qwen3-Next / Qwen3.5 hyperparameters after moe_hparams: the shared expert's size, the
    gated-delta-net shape (head dim = the attention head dim) and the layer pattern."""
    m.kv("expert_shared_feed_forward_length", m.n_ff)
    m.kv("ssm.conv_kernel", _GDN_CONV_KERNEL)
    m.kv("ssm.state_size", m.head_dim)
    m.kv("ssm.group_count", _GDN_K_HEADS)
    m.kv("ssm.time_step_rank", _GDN_V_HEADS)
    m.kv("ssm.inner_size", _GDN_V_HEADS * m.head_dim)
    m.kv("full_attention_interval", _FULL_ATTENTION_INTERVAL)


def _gated_attention(m: TinyModel, i: int) -> None:
    """Full attention whose Q projection also yields a per-head output gate (2x the Q rows)."""
    p, d = f"blk.{i}.", m.head_dim
    m.weight(p + "attn_q.weight", 2 * m.n_head * d, m.n_embd)
    m.weight(p + "attn_k.weight", m.n_head_kv * d, m.n_embd)
    m.weight(p + "attn_v.weight", m.n_head_kv * d, m.n_embd)
    m.weight(p + "attn_output.weight", m.n_embd, m.n_head * d)
    m.ones(p + "attn_q_norm.weight", d)
    m.ones(p + "attn_k_norm.weight", d)


def _gated_delta_net(m: TinyModel, i: int, *, fused_beta_alpha: bool) -> None:
    """Linear attention (gated delta net) as convert_hf_to_gguf writes it: fused qkv, output
    gate z, conv, decay (ssm_a = -A, A ~ U(1, 16) as the HF init; dt bias ~ 1) and beta/alpha
    projections, in one tensor (Qwen3-Next) or two (Qwen3.5)."""
    p, d, e = f"blk.{i}.", m.head_dim, m.n_embd
    key_dim, value_dim = _GDN_K_HEADS * d, _GDN_V_HEADS * d
    m.weight(p + "attn_qkv.weight", 2 * key_dim + value_dim, e)
    m.weight(p + "attn_gate.weight", value_dim, e)
    m.weight(p + "ssm_conv1d.weight", 2 * key_dim + value_dim, _GDN_CONV_KERNEL)
    m.tensor(p + "ssm_dt.bias", 1.0 + m.normal(_GDN_V_HEADS, std=0.1))
    m.tensor(p + "ssm_a", -m.rng.uniform(1.0, 16.0, _GDN_V_HEADS).astype(np.float32))
    if fused_beta_alpha:
        m.weight(p + "ssm_ba.weight", 2 * _GDN_V_HEADS, e)
    else:
        m.weight(p + "ssm_beta.weight", _GDN_V_HEADS, e)
        m.weight(p + "ssm_alpha.weight", _GDN_V_HEADS, e)
    m.ones(p + "ssm_norm.weight", d)
    m.weight(p + "ssm_out.weight", e, value_dim)


def _sigmoid_gated_shared_expert(m: TinyModel, i: int) -> None:
    """A SiLU shared expert (F32, not cached) scaled by sigmoid(ffn_gate_inp_shexp . x)."""
    m.weight(f"blk.{i}.ffn_gate_inp_shexp.weight", m.n_embd)
    _gated_ffn(m, i, "_shexp", m.n_ff)


def _hybrid_layers(m: TinyModel, *, gate_up: bool, fused_beta_alpha: bool) -> None:
    """Head and layers of a Qwen3-Next-style hybrid: linear or full attention, then a post
    attention norm and the MoE FFN (routed experts plus the gated shared expert)."""
    m.head()
    for i in range(m.n_layer):
        m.ones(f"blk.{i}.attn_norm.weight", m.n_embd)
        m.ones(f"blk.{i}.post_attention_norm.weight", m.n_embd)
        if (i + 1) % _FULL_ATTENTION_INTERVAL:  # as the loader marks the recurrent layers
            _gated_delta_net(m, i, fused_beta_alpha=fused_beta_alpha)
        else:
            _gated_attention(m, i)
        m.router(i)
        m.routed_experts(i, gate_up=gate_up)
        _sigmoid_gated_shared_expert(m, i)


@architecture("qwen3next")
def _qwen3next(m: TinyModel) -> None:
    """Qwen3-Next-80B-A3B: softmax top-k, SiLU, fused ffn_gate_up_exps, gated shared expert."""
    m.moe_hparams()
    _hybrid_hparams(m)
    _hybrid_layers(m, gate_up=True, fused_beta_alpha=True)


@architecture("qwen35moe")
def _qwen35moe(m: TinyModel) -> None:
    """Qwen3.5-35B-A3B..397B-A17B MoE: softmax top-k, SiLU, gate/up/down, gated shared expert."""
    m.moe_hparams()
    _hybrid_hparams(m)
    # interleaved M-RoPE sections (text positions: same in all), like the real [11, 11, 10, 0]
    # of a 64-dim rotary part: here they split the head dim's 8 rotary pairs
    m.kv("rope.dimension_sections", [3, 3, 2, 0])
    _hybrid_layers(m, gate_up=False, fused_beta_alpha=False)


# --- MLA, DeepSeek-style routing and hyper-connections: DeepSeek-V3, DeepSeek-V4, Kimi-K3, GLM-5 --

class Mla(NamedTuple):
    """Multi-head latent attention's sizes (q_lora_rank 0: no query compression)."""
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope: int = 16
    qk_rope: int = 8
    v_head: int = 16


def _mla_hparams(m: TinyModel, mla: Mla, kv_heads: int | list[int]) -> None:
    """MLA served as MQA: one KV head (kv_heads: 1, or per layer 1 or 0 for a recurrent layer)
    holding the latent and its rope part; the sizes of the decompressed heads apart."""
    m.kv("attention.head_count_kv", kv_heads)
    if mla.q_lora_rank:
        m.kv("attention.q_lora_rank", mla.q_lora_rank)
    m.kv("attention.kv_lora_rank", mla.kv_lora_rank)
    m.kv("attention.key_length", mla.kv_lora_rank + mla.qk_rope)
    m.kv("attention.value_length", mla.kv_lora_rank)
    m.kv("rope.dimension_count", mla.qk_rope)
    m.kv("attention.key_length_mla", mla.qk_nope + mla.qk_rope)
    m.kv("attention.value_length_mla", mla.v_head)


def _mla_attention(m: TinyModel, i: int, mla: Mla) -> None:
    """Layer i's MLA projections, wkv_b split into k_b and v_b (what current GGUFs store)."""
    p, h = f"blk.{i}.", m.n_head
    if mla.q_lora_rank:
        m.weight(p + "attn_q_a.weight", mla.q_lora_rank, m.n_embd)
        m.ones(p + "attn_q_a_norm.weight", mla.q_lora_rank)
        m.weight(p + "attn_q_b.weight", h * (mla.qk_nope + mla.qk_rope), mla.q_lora_rank)
    else:
        m.weight(p + "attn_q.weight", h * (mla.qk_nope + mla.qk_rope), m.n_embd)
    m.weight(p + "attn_kv_a_mqa.weight", mla.kv_lora_rank + mla.qk_rope, m.n_embd)
    m.ones(p + "attn_kv_a_norm.weight", mla.kv_lora_rank)
    m.weight(p + "attn_k_b.weight", h, mla.kv_lora_rank, mla.qk_nope)
    m.weight(p + "attn_v_b.weight", h, mla.v_head, mla.kv_lora_rank)
    m.weight(p + "attn_output.weight", m.n_embd, h * mla.v_head)


def _deepseek_moe_hparams(m: TinyModel, *, gating: int, scale: float) -> None:
    """DeepSeek-V3-style routing: biased selection, renormalized and scaled weights, one shared
    expert, every layer MoE."""
    m.kv("leading_dense_block_count", 0)
    m.kv("expert_shared_count", 1)
    m.kv("expert_weights_scale", scale)
    m.kv("expert_weights_norm", True)
    m.kv("expert_gating_func", gating)


def _deepseek_moe(m: TinyModel, i: int) -> None:
    """Layer i's FFN: norm, router with its selection bias, the routed experts and the shared
    one."""
    m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
    m.router(i)
    _expert_probs_bias(m, i, std=0.1)
    m.routed_experts(i)
    _gated_ffn(m, i, "_shexp", m.n_ff)


def _mhc_hparams(m: TinyModel) -> None:
    """Manifold-constrained hyper-connections: 4 residual streams mixed by Sinkhorn."""
    m.kv("hyper_connection.count", HC_MULT)
    m.kv("hyper_connection.sinkhorn_iterations", 20)
    m.kv("hyper_connection.epsilon", 1e-6)


def _mhc(m: TinyModel, i: int) -> None:
    """Layer i's stream mixers around attention and FFN: mixes ~ N(0, 1), no base offset."""
    n_mix = (2 + HC_MULT) * HC_MULT
    for part in ("attn", "ffn"):
        p = f"blk.{i}.hc_{part}_"
        m.weight(p + "fn.weight", n_mix, HC_MULT * m.n_embd)
        m.zeros(p + "base.weight", n_mix)
        m.ones(p + "scale.weight", 3)


def _kda_hparams(m: TinyModel) -> None:
    m.kv("ssm.conv_kernel", 4)
    m.kv("kda.head_dim", m.head_dim)


def _kda(m: TinyModel, i: int, *, full_rank_gate: bool) -> None:
    """Layer i's Kimi delta attention, with decays in a stable range (ssm_a = -exp(A_log) in
    [-4, -1], as FLA initializes it)."""
    p, d, h = f"blk.{i}.", m.head_dim, m.n_head
    inner = d * h
    for x in "qkv":
        m.weight(p + f"ssm_conv1d_{x}.weight", 1, inner, 1, 4, std=0.5)
        m.weight(p + f"attn_{x}.weight", inner, m.n_embd)
    m.weight(p + "ssm_f_a.weight", d, m.n_embd)
    m.weight(p + "ssm_f_b.weight", inner, d)
    m.weight(p + "ssm_beta.weight", h, m.n_embd)
    m.tensor(p + "ssm_a", -m.rng.uniform(1.0, 4.0, h).astype(np.float32))
    m.weight(p + "ssm_dt.bias", inner, std=0.1)
    if full_rank_gate:
        m.weight(p + "ssm_g.weight", inner, m.n_embd)
    else:
        m.weight(p + "ssm_g_a.weight", d, m.n_embd)
        m.weight(p + "ssm_g_b.weight", inner, d)
    m.ones(p + "ssm_norm.weight", d)
    m.weight(p + "attn_output.weight", m.n_embd, inner)


@architecture("deepseek2")
def _deepseek2(m: TinyModel) -> None:
    """DeepSeek-V3/R1, Kimi-K2: MLA, sigmoid routing with exp_probs_b over expert groups,
    renormalized scaled weights, SwiGLU experts plus a shared expert."""
    mla = Mla()
    m.moe_hparams()
    _mla_hparams(m, mla, 1)
    _deepseek_moe_hparams(m, gating=SIGMOID, scale=2.5)
    m.kv("expert_group_count", 4)  # V3's group-limited routing: the best 2 groups of 2
    m.kv("expert_group_used_count", 2)
    m.head()
    for i in range(m.n_layer):
        m.ones(f"blk.{i}.attn_norm.weight", m.n_embd)
        _mla_attention(m, i, mla)
        _deepseek_moe(m, i)


def _dsv4_attention(m: TinyModel, i: int, *, q_lora_rank: int, o_groups: int,
                    o_lora_rank: int) -> None:
    """Layer i's DeepSeek-V4 attention: compressed query, one shared KV head, sinks and a
    grouped low-rank output."""
    p, d, h = f"blk.{i}.", m.head_dim, m.n_head
    m.ones(p + "attn_norm.weight", m.n_embd)
    m.weight(p + "attn_sinks.weight", h, std=0.1)
    m.weight(p + "attn_q_a.weight", q_lora_rank, m.n_embd)
    m.ones(p + "attn_q_a_norm.weight", q_lora_rank)
    m.weight(p + "attn_q_b.weight", h * d, q_lora_rank)
    m.weight(p + "attn_kv.weight", d, m.n_embd)
    m.ones(p + "attn_kv_a_norm.weight", d)
    # as the file stores it: [o_lora_rank*o_groups, n_head*head_dim/o_groups] (the loader reshapes)
    m.weight(p + "attn_output_a.weight", o_lora_rank * o_groups, h * d // o_groups)
    m.weight(p + "attn_output_b.weight", m.n_embd, o_lora_rank * o_groups)


def _dsv4_csa(m: TinyModel, i: int, *, q_lora_rank: int, n_idx_head: int, idx_dim: int) -> None:
    """Layer i's compressed sparse attention (ratio 4): the KV compressor and the lightning
    indexer that picks the compressed blocks to attend."""
    p, d, ratio = f"blk.{i}.", m.head_dim, 4
    for name, width in (("attn_compressor", 2 * d), ("indexer_compressor", 2 * idx_dim)):
        m.weight(p + name + "_kv.weight", width, m.n_embd)
        m.weight(p + name + "_gate.weight", width, m.n_embd)
        m.weight(p + name + "_ape.weight", ratio, width, std=0.1)
        m.ones(p + name + "_norm.weight", width // 2)
    m.weight(p + "indexer.proj.weight", n_idx_head, m.n_embd)
    m.weight(p + "indexer.attn_q_b.weight", n_idx_head * idx_dim, q_lora_rank)


def _hash_routing(m: TinyModel, i: int) -> None:
    """A hash layer's token -> experts table: n_expert_used distinct experts per token."""
    order = np.argsort(m.rng.random((m.n_vocab, m.n_expert)), axis=1)
    m.tensor(f"blk.{i}.ffn_gate_tid2eid.weight", order[:, :m.n_expert_used].astype(np.int32))


@architecture("deepseek4")
def _deepseek4(m: TinyModel) -> None:
    """DeepSeek-V4-Flash: mHC streams; sqrt-softplus routing, by a token hash table in
    layer 0 and by score with exp_probs_b in layer 1; clamped SwiGLU experts plus a shared
    expert."""
    q_lora_rank, o_groups, o_lora_rank, n_hash = 32, 2, 16, 1
    n_idx_head, idx_dim = 2, 64  # the indexer's Hadamard rotation needs a multiple of 64
    # sliding window alone, then compressed sparse attention (4 tokens a block); V4 has both,
    # and without a ratio-4 layer the empty indexer cache's rotation size loops down to 0
    ratios = [0, 4]
    m.moe_hparams()
    m.kv("attention.head_count_kv", 1)  # one KV head shared by all query heads
    m.kv("rope.dimension_count", m.head_dim // 2)  # rope on the tail half
    m.kv("embedding_length_out", HC_MULT * m.n_embd)
    m.kv("attention.q_lora_rank", q_lora_rank)
    m.kv("attention.sliding_window", 128)
    m.kv("attention.compress_ratios", [ratios[i % 2] for i in range(m.n_layer)])
    m.kv("attention.compress_rope_freq_base", 160000.0)
    m.kv("attention.output_group_count", o_groups)
    m.kv("attention.output_lora_rank", o_lora_rank)
    m.kv("attention.indexer.head_count", n_idx_head)
    m.kv("attention.indexer.key_length", idx_dim)
    m.kv("attention.indexer.top_k", 8)
    _deepseek_moe_hparams(m, gating=SQRT_SOFTPLUS, scale=1.5)
    m.kv("swiglu_clamp_exp", [10.0] * m.n_layer)
    m.kv("swiglu_clamp_shexp", [10.0] * m.n_layer)
    m.kv("hash_layer_count", n_hash)
    _mhc_hparams(m)
    m.head()
    m.weight("output_hc_fn.weight", HC_MULT, HC_MULT * m.n_embd)
    m.zeros("output_hc_base.weight", HC_MULT)
    m.ones("output_hc_scale.weight", 1)
    for i in range(m.n_layer):
        _dsv4_attention(m, i, q_lora_rank=q_lora_rank, o_groups=o_groups, o_lora_rank=o_lora_rank)
        if ratios[i % 2]:
            _dsv4_csa(m, i, q_lora_rank=q_lora_rank, n_idx_head=n_idx_head, idx_dim=idx_dim)
        _mhc(m, i)
        m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.router(i)
        if i < n_hash:
            _hash_routing(m, i)
        else:
            _expert_probs_bias(m, i, std=0.1)
        m.routed_experts(i)
        _gated_ffn(m, i, "_shexp", m.n_ff)


def _latent_moe(m: TinyModel, i: int, latent: int) -> None:
    """Layer i's Kimi-K3 FFN: the router reads the full input, the routed experts run in a
    down-projected latent space (normed, then projected back up), the shared expert at n_embd."""
    p, e, f = f"blk.{i}.", m.n_expert, m.n_ff
    m.ones(p + "ffn_norm.weight", m.n_embd)
    m.router(i)
    _expert_probs_bias(m, i, std=0.1)
    m.weight(p + "ffn_routed_down.weight", latent, m.n_embd)
    m.experts(p + "ffn_gate_exps.weight", e, f, latent)
    m.experts(p + "ffn_up_exps.weight", e, f, latent)
    m.experts(p + "ffn_down_exps.weight", e, latent, f)
    m.ones(p + "ffn_routed_norm.weight", latent)
    m.weight(p + "ffn_routed_up.weight", m.n_embd, latent)
    _gated_ffn(m, i, "_shexp", m.n_ff)


@architecture("kimi-k3")
def _kimi_k3(m: TinyModel) -> None:
    """Kimi-K3: KDA + gated MLA layers with cross-layer residual attention; SITU experts in a
    latent space (expert_latent_length), sigmoid routing with exp_probs_b, a shared expert."""
    # as Kimi-Linear's: the query uncompressed; the k_pe part stored but never rotated
    mla, latent = Mla(q_lora_rank=0), 32
    kv_heads = [i % 2 for i in range(m.n_layer)]  # 0: a KDA layer; K3 has 3 per MLA layer
    m.moe_hparams()
    _mla_hparams(m, mla, kv_heads)
    _kda_hparams(m)
    m.kv("kda.gate_lower_bound", -5.0)
    _deepseek_moe_hparams(m, gating=SIGMOID, scale=2.5)
    m.kv("expert_latent_length", latent)
    m.kv("activation.situ_beta", 2.0)  # tanh soft caps at the scale of the tiny activations
    m.kv("activation.situ_linear_beta", 2.0)
    m.kv("attn_res.block_size", 2)  # layer 0 banks its input, layer 1 adds to the stream
    m.head()
    m.weight("output_res_score.weight", m.n_embd)
    for i in range(m.n_layer):
        p = f"blk.{i}."
        m.ones(p + "attn_norm.weight", m.n_embd)
        m.weight(p + "attn_res_score.weight", m.n_embd)
        m.weight(p + "ffn_res_score.weight", m.n_embd)
        if kv_heads[i]:
            _mla_attention(m, i, mla)
            m.weight(p + "attn_gate.weight", m.n_head * mla.v_head, m.n_embd)  # sigmoid output gate
        else:
            _kda(m, i, full_rank_gate=True)
        _latent_moe(m, i, latent)


def _kpool_indexer(m: TinyModel, i: int, mla: Mla, *, n_idx_head: int, idx_dim: int,
                   kpool: int) -> None:
    """Layer i's DSA indexer with k-pool compression: keys pooled kpool tokens at a time by a
    gated softmax, pools scored per query to pick which tokens the MLA attends."""
    p = f"blk.{i}."
    m.weight(p + "indexer.attn_k.weight", idx_dim, m.n_embd)
    m.ones(p + "indexer.k_norm.weight", idx_dim)
    m.weight(p + "indexer.k_norm.bias", idx_dim, std=0.1)
    m.weight(p + "indexer.proj.weight", n_idx_head, m.n_embd)
    m.weight(p + "indexer.attn_q_b.weight", n_idx_head * idx_dim, mla.q_lora_rank)
    m.weight(p + "indexer_compressor_gate.weight", idx_dim, m.n_embd)
    m.weight(p + "indexer_compressor_ape.weight", kpool, idx_dim, std=0.1)


@architecture("glm5-next")
def _glm5_next(m: TinyModel) -> None:
    """GLM-5.3-Flash: mHC streams over KDA and nope-MLA layers (k-pool DSA indexer);
    DeepSeek-style sigmoid routing with exp_probs_b, clamped SwiGLU experts, a shared expert."""
    mla = Mla(qk_rope=0)  # nope-only MLA
    n_idx_head, idx_dim, kpool = 2, 16, 4
    kv_heads = [i % 2 for i in range(m.n_layer)]  # 0: a KDA layer
    m.moe_hparams()
    _mla_hparams(m, mla, kv_heads)
    m.kv("attention.layer_norm_epsilon", 1e-6)  # the indexer's key norm is a LayerNorm
    _kda_hparams(m)
    m.kv("attention.indexer.head_count", n_idx_head)
    m.kv("attention.indexer.key_length", idx_dim)
    m.kv("attention.indexer.top_k", 2 * kpool)  # the best 2 pools, and the incomplete tail
    m.kv("attention.indexer.kpool", kpool)
    m.kv("attention.indexer.kpool_select_tail", True)
    _mhc_hparams(m)
    _deepseek_moe_hparams(m, gating=SIGMOID, scale=2.5)
    m.kv("swiglu_clamp_exp", [10.0] * m.n_layer)
    m.kv("swiglu_clamp_shexp", [10.0] * m.n_layer)
    m.head()
    for i in range(m.n_layer):
        m.ones(f"blk.{i}.attn_norm.weight", m.n_embd)
        _mhc(m, i)
        if kv_heads[i]:
            _mla_attention(m, i, mla)
            _kpool_indexer(m, i, mla, n_idx_head=n_idx_head, idx_dim=idx_dim, kpool=kpool)
        else:
            _kda(m, i, full_rank_gate=False)
        _deepseek_moe(m, i)
