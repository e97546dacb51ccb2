"""KeyRotation (graphchunk/blend/rope.py): moving cached K by R(delta) equals computing it at the new position.

Oracle: HF transformers (eager, fp32) computing a chunk alone at positions a..a+L-1; the rotation
comes from vLLM's own rotary module for the same config (``get_rope``), as blend mode builds it.
"""
import pytest
import torch
import transformers

from graphchunk.blend.rope import KeyRotation
from graphchunk.config import ConfigError
from graphchunk.reference import models

L = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One OpenMP thread: on the shared 2-core machine two spin-waiting threads are several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def vllm_rope(head_size, max_position, rope_parameters, is_neox_style=True):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(head_size, max_position, is_neox_style, dict(rope_parameters), torch.float32)


def _tiny_llama(rope_parameters, max_position_embeddings):
    config = transformers.LlamaConfig(vocab_size=49152, max_position_embeddings=max_position_embeddings,
                                      rope_parameters=rope_parameters, **models._TINY_SHAPE)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def _load(variant):
    if variant == "smollm2":
        path = models.smollm2_path()
    elif variant.startswith("tiny-"):
        path = models.tiny_checkpoint(variant.removeprefix("tiny-"))
    elif variant == "linear":
        return _tiny_llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 4096)
    else:  # yarn: cache rows = original_max_position_embeddings * factor
        return _tiny_llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 2048}, 8192)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@torch.no_grad()
def _kv(model, ids, start):
    """Per layer (K, V), each [tokens, kv_heads, head_dim], of ``ids`` computed alone at start.."""
    cache = transformers.DynamicCache()
    model(input_ids=ids[None], position_ids=torch.arange(start, start + len(ids))[None],
          past_key_values=cache, use_cache=True)
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


# Measured max over layers and moves of |rotated K(a) - K(b)| / max |K(b)| (and the same for V,
# which does not move), CPU fp32; it grows with the offset (fp32 angle rounding, ~ulp(b * freq)):
#   smollm2 K 2.4e-5 V 2.0e-5 | llama3 2.4e-5 1.0e-5 | qwen2 5.3e-5 1.6e-5 | qwen3 3.5e-5 8.2e-6
#   linear  1.9e-5   8.4e-6   | yarn   3.4e-5 1.7e-5
# Layer 0 alone (identical inputs, so pure rotation error): 4.5e-7..9.5e-7 at 0->37, up to 4.2e-5 at 0->1500.
TOL = 5e-4
MOVES = [(0, 37), (0, 500), (0, 1500), (10, 300)]


@pytest.mark.parametrize("variant", ["smollm2", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "linear", "yarn"])
def test_rotated_keys_equal_keys_computed_at_offset(variant, vllm_config):
    torch.manual_seed(1)
    model = _load(variant)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotation = KeyRotation.from_module(vllm_rope(head_dim, cfg.max_position_embeddings, cfg.rope_parameters))
    ids = torch.randint(100, 49000, (L,))
    kv = {p: _kv(model, ids, p) for p in {p for move in MOVES for p in move}}
    worst = worst_v = 0.0
    for a, b in MOVES:
        for (k_a, v_a), (k_b, v_b) in zip(kv[a], kv[b]):
            scale = k_b.abs().max()
            moved = rotation.rotate(k_a, torch.full((L,), b - a))
            err = float((moved - k_b).abs().max() / scale)
            err_v = float((v_a - v_b).abs().max() / v_b.abs().max())  # V does not move
            worst, worst_v = max(worst, err), max(worst_v, err_v)
            assert err < TOL and err_v < TOL, (variant, a, b, err, err_v)
            # The check has teeth: one position off is far outside the tolerance.
            wrong = rotation.rotate(k_a, torch.full((L,), b - a + 1))
            assert float((wrong - k_b).abs().max() / scale) > 100 * TOL
    print(f"{variant}: max relative difference K {worst:.1e} V {worst_v:.1e}")


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},  # pass-through dims
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
], ids=["default", "partial", "yarn"])
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
def test_rotation_matches_vllm_forward(rope_parameters, is_neox_style, vllm_config):
    """vLLM's own forward at positions p, rotated by per-token deltas d, equals its forward at p + d."""
    rope = vllm_rope(64, 4096, rope_parameters, is_neox_style)
    rotation = KeyRotation.from_module(rope)
    gen = torch.Generator().manual_seed(2)
    n, heads = 50, 3
    key = torch.randn(n, heads * 64, generator=gen)
    positions = torch.randint(0, 1000, (n,), generator=gen)
    deltas = torch.randint(0, 3000, (n,), generator=gen)
    deltas[0] = 0

    def at(pos):
        return rope.forward_native(pos, key.clone(), key.clone())[1].view(n, heads, 64)

    moved = rotation.rotate(at(positions), deltas)
    # Backwards too (a chunk's keys taken from where a full prefill computed them, moved towards 0).
    torch.testing.assert_close(rotation.rotate(at(positions + deltas), -deltas), at(positions), rtol=0, atol=5e-3)
    # Measured max abs difference 1.5e-4..5.0e-4 (keys ~N(0, 1); positions up to 4000, fp32 angle rounding).
    atol = 5e-3
    torch.testing.assert_close(moved, at(positions + deltas), rtol=0, atol=atol)
    assert (rotation.rotate(at(positions), deltas + 1) - at(positions + deltas)).abs().max() > 100 * atol
    if rope_parameters.get("partial_rotary_factor"):
        assert torch.equal(moved[..., 32:], key.view(n, heads, 64)[..., 32:])


def test_refuses_dynamic_ntk(vllm_config):
    rope = vllm_rope(64, 2048, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ConfigError, match=r"dynamic NTK.*DynamicNTKScalingRotaryEmbedding"):
        KeyRotation.from_module(rope)
    with pytest.raises(ConfigError, match="dynamic NTK"):
        KeyRotation.from_model(torch.nn.ModuleList([torch.nn.Linear(2, 2), rope]))


def test_refuses_mrope(vllm_config):
    rope = vllm_rope(64, 2048, {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    with pytest.raises(ConfigError, match="MRotaryEmbedding"):
        KeyRotation.from_module(rope)


def test_refuses_model_without_rope():
    with pytest.raises(ConfigError, match=r"(?s)RoPE.*none"):
        KeyRotation.from_model(torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)))


def test_refuses_deltas_past_the_rotary_cache(vllm_config):
    rotation = KeyRotation.from_module(vllm_rope(64, 256, {"rope_type": "default", "rope_theta": 10000.0}))
    k = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="256 positions"):
        rotation.rotate(k, torch.tensor([0, 256]))
    with pytest.raises(ValueError, match="256 positions"):
        rotation.rotate(k, torch.tensor([0, -256]))
    torch.testing.assert_close(rotation.rotate(rotation.rotate(k, torch.tensor([255, 3])), torch.tensor([-255, -3])), k,
                               rtol=0, atol=1e-5)
