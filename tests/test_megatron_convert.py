"""megatron backend: GPTModel built from HF Qwen2 / Llama configs gives HF's logits, and the HF <->
Megatron weight conversion round-trips bit-identically at every TP x PP layout."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from _dist_helpers import gloo_world_of_one, launch_workers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from arealcli.runtime.backends.megatron import convert, model  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

VOCAB = 100  # not a multiple of the 128-row padding unit
BATCH, SEQ = 2, 16
LOGIT_ATOL = 1e-5


def tiny_hf_model(family: str, *, tied: bool = False, layers: int = 4):
    """A seeded fp32 HF model whose every weight is random (norms too, so swapping two norms or
    misplacing a bias shows up in the logits)."""
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if family == "qwen2":
        config, cls = Qwen2Config(rope_theta=1e6, **common), Qwen2ForCausalLM
    else:
        config, cls = LlamaConfig(rope_theta=5e5, **common), LlamaForCausalLM
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return hf


MODELS = {  # name -> (family, tied)
    "qwen2": ("qwen2", False),
    "qwen2-tied": ("qwen2", True),
    "llama": ("llama", False),
    "llama-tied": ("llama", True),
}


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def hf_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(fixed_batch()).logits  # (B, T, V)


# ---------------------------------------------------------------------------------------------
# (b) conversion round trip, as pure functions over every (tp_rank, pp_rank)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4)])
def test_round_trip_is_bit_identical(name: str, tp: int, pp: int) -> None:
    family, tied = MODELS[name]
    hf = tiny_hf_model(family, tied=tied)
    hf_sd = hf.state_dict()
    shards = [[convert.hf_to_megatron(hf_sd, hf.config, r, tp, p, pp) for r in range(tp)] for p in range(pp)]
    back = convert.megatron_to_hf(shards, hf.config, tp, pp)

    assert list(back) == list(hf_sd)
    for key, tensor in hf_sd.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    padded = model.padded_vocab_size(VOCAB, tp)
    assert shards[0][0]["embedding.word_embeddings.weight"].shape == (padded // tp, 64)
    assert ("output_layer.weight" in shards[-1][0]) == (not tied or pp > 1)


def test_qkv_layout_is_grouped_per_kv_head() -> None:
    """Fused QKV rows: [q heads of group 0, k0, v0, q heads of group 1, k1, v1] (head dim 1 here)."""
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # 4 query heads
    k = torch.tensor([[10.0], [11.0]])  # 2 groups
    v = torch.tensor([[20.0], [21.0]])
    fused = convert.qkv_to_megatron(q, k, v, num_query_groups=2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.flatten().tolist() for t in convert.qkv_from_megatron(fused, 4, 2, 1)] == [
        [0, 1, 2, 3],
        [10, 11],
        [20, 21],
    ]


def test_fc1_is_gate_then_up_per_tp_rank() -> None:
    gate, up = torch.arange(4.0).unsqueeze(1), torch.arange(10.0, 14.0).unsqueeze(1)
    ranks = [convert.fc1_to_megatron(gate, up, r, 2) for r in range(2)]
    assert [r.flatten().tolist() for r in ranks] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    merged = convert.fc1_from_megatron(ranks)
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


def test_bad_state_dict_is_rejected() -> None:
    hf = tiny_hf_model("llama", layers=2)
    sd = dict(hf.state_dict())
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(KeyError, match="unexpected"):
        convert.hf_to_megatron(sd, hf.config, 0, 1, 0, 1)


def test_config_reads_rope_gqa_bias_and_ties() -> None:
    qwen = tiny_hf_model("qwen2", tied=True, layers=2).config
    cfg = model.transformer_config_from_hf(qwen, torch.float32)
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.add_qkv_bias, cfg.add_bias_linear) == (
        2,
        16,
        True,
        False,
    )
    assert (
        cfg.gated_linear_unit
        and cfg.normalization == "RMSNorm"
        and cfg.layernorm_epsilon == qwen.rms_norm_eps
    )
    assert model.rope_settings(qwen) == {"rotary_base": 1e6, "rope_scaling": False}
    llama = tiny_hf_model("llama", layers=2).config
    assert not model.transformer_config_from_hf(llama, torch.float32).add_qkv_bias
    assert model.rope_settings(llama)["rotary_base"] == 5e5

    class LegacyConfig:  # transformers 4.x: top-level rope_theta, no rope_parameters
        rope_theta = 123.0
        rope_scaling = None

    assert model.rope_settings(LegacyConfig()) == {"rotary_base": 123.0, "rope_scaling": False}


# ---------------------------------------------------------------------------------------------
# (a) one process, TP = PP = 1: megatron logits == HF logits
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_world_of_one():
    with gloo_world_of_one():
        model.init_parallel(1, 1)
        try:
            yield
        finally:
            model.destroy_parallel()


@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("name", list(MODELS))
def test_single_process_logits_match_hf(megatron_world_of_one, name: str, attention: str) -> None:
    family, tied = MODELS[name]
    hf = tiny_hf_model(family, tied=tied)
    gpt = model.build_gpt_model(hf.config, attention=attention).eval()
    gpt.load_state_dict(convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1, 0, 1), strict=True)

    ids = fixed_batch()
    with torch.no_grad():
        logits = gpt(ids, torch.arange(SEQ).expand(BATCH, SEQ), None)  # (B, T, padded V)
    assert logits.shape == (BATCH, SEQ, model.padded_vocab_size(VOCAB, 1))
    torch.testing.assert_close(logits[..., :VOCAB], hf_logits(hf), rtol=0, atol=LOGIT_ATOL)
    assert torch.count_nonzero(logits[..., VOCAB:]) == 0  # padded vocab rows are zero


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_single_process_gradients_match_hf(megatron_world_of_one, attention: str) -> None:
    """Backward too: HF's gradients, mapped through the same conversion, equal megatron's."""
    hf = tiny_hf_model("qwen2", tied=True, layers=2)
    gpt = model.build_gpt_model(hf.config, attention=attention)
    gpt.load_state_dict(convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1, 0, 1), strict=True)
    ids = fixed_batch()

    def next_token_loss(logits: torch.Tensor) -> torch.Tensor:  # logits (B, T, V)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    next_token_loss(hf(ids).logits).backward()
    next_token_loss(gpt(ids, torch.arange(SEQ).expand(BATCH, SEQ), None)[..., :VOCAB]).backward()

    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    hf_grads["lm_head.weight"] = hf_grads["model.embed_tokens.weight"]  # tied: one parameter
    expected = convert.hf_to_megatron(hf_grads, hf.config, 0, 1, 0, 1)
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-5, msg=name)


def test_sdpa_attention_matches_local_with_explicit_mask(megatron_world_of_one) -> None:
    """Same inputs through SDPAttention and megatron's DotProductAttention: GQA + a padding mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from arealcli.runtime.backends.megatron.sdpa_attention import SDPAttention

    cfg = model.transformer_config_from_hf(tiny_hf_model("qwen2", layers=2).config, torch.float32)
    sq, b, hn = 8, 2, cfg.kv_channels
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sq, b, 4, hn, generator=gen)  # [s, b, np, hn]
    k, v = torch.randn(2, sq, b, 2, hn, generator=gen)  # [s, b, ng, hn]
    mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1).expand(b, 1, sq, sq).clone()
    mask[1, :, :, :3] = True  # sample 1: first 3 keys are padding ...
    mask[1, :, :3, :3] = torch.triu(
        torch.ones(3, 3, dtype=torch.bool), diagonal=1
    )  # ... except to themselves
    for attention_mask in (None, mask):
        outs = [
            cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")(
                q, k, v, attention_mask
            )
            for cls in (SDPAttention, DotProductAttention)
        ]
        assert outs[0].shape == (sq, b, 4 * hn)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_cpu_workarounds_stay_off_when_cuda_is_available(monkeypatch) -> None:
    from arealcli.runtime.backends.megatron import cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply_cpu_workarounds() is False
    cfg = model.transformer_config_from_hf(tiny_hf_model("llama", layers=2).config, torch.bfloat16)
    assert not cfg.use_cpu_initialization and cfg.bf16


def test_unknown_attention_is_an_error() -> None:
    with pytest.raises(ValueError, match="'sdpa' or 'local'"):
        model.gpt_layer_spec("flash")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# (c) real processes (gloo): TP = 2, PP = 2 (stages run by hand), and (slow) TP2 x PP2, TP4
# ---------------------------------------------------------------------------------------------


def run_dist_job(workdir, nprocs: int, layouts: list[tuple[int, int]]):
    """Run every MODELS x layouts x attention case in one ``nprocs``-process job (process start-up
    dominates the cost); returns ({(name, attention, tp, pp): logits}, {name: HF logits})."""
    torch.save(fixed_batch(), workdir / "input_ids.pt")
    reference = {}
    for name, (family, tied) in MODELS.items():
        hf = tiny_hf_model(family, tied=tied)
        (workdir / name).mkdir()
        hf.config.save_pretrained(workdir / name)
        torch.save(hf.state_dict(), workdir / name / "hf_state.pt")
        reference[name] = hf_logits(hf)
    layout_arg = ",".join(f"{tp}x{pp}" for tp, pp in layouts)
    launch_workers(nprocs, ["--workdir", str(workdir), "--layouts", layout_arg, "--attentions", "sdpa,local"])
    results = {
        (name, attention, tp, pp): torch.load(workdir / f"{name}_{attention}_tp{tp}pp{pp}.pt")
        for name in MODELS
        for attention in ("sdpa", "local")
        for tp, pp in layouts
    }
    return results, reference


TWO_PROCESS_LAYOUTS = [(2, 1), (1, 2)]
FOUR_PROCESS_LAYOUTS = [(2, 2), (4, 1)]  # TP=4 > 2 KV heads: megatron's split-group QKV path


@pytest.fixture(scope="module")
def two_process_logits(tmp_path_factory):
    return run_dist_job(tmp_path_factory.mktemp("megatron_2proc"), 2, TWO_PROCESS_LAYOUTS)


@pytest.mark.parametrize("tp,pp", TWO_PROCESS_LAYOUTS)
@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("name", list(MODELS))
def test_two_process_logits_match_hf(two_process_logits, name: str, attention: str, tp: int, pp: int) -> None:
    results, reference = two_process_logits
    torch.testing.assert_close(results[name, attention, tp, pp], reference[name], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.slow
def test_four_process_logits_match_hf(tmp_path) -> None:
    """TP=2 x PP=2 and TP=4, four gloo processes on however many cores there are (~15 s on 2)."""
    results, reference = run_dist_job(tmp_path, 4, FOUR_PROCESS_LAYOUTS)
    for (name, *_), logits in results.items():
        torch.testing.assert_close(logits, reference[name], rtol=0, atol=LOGIT_ATOL)
