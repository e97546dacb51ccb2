"""graphchunk's KV code on a device's real tensors, without vLLM (issue 27, item 4).

Checks, pass/fail each, in every one of vLLM 0.32's six ``KVCacheLayout``s, against the logical
view (K at ``cache[block, head, offset, :D]``, V at ``[..., D:]``) of caches allocated as vLLM's
``allocate_kv_cache`` does (one buffer in the layout's physical order of logical ``[layers, blocks,
heads, block_size, 2 * head_size]``, one strided view per layer; ``vllm_caches``):

* ``write``: a torch reference of ``reshape_and_cache_flash`` over ``kv_cache.transpose(1, 2)
  .split(head_size, -1)`` (the KV write of FlashAttention, FlashInfer, FlexAttention and Triton
  attention; ``tests/gpu_style.py``'s stand-in) writes where the view says, nothing else; every
  cache is filled through it;
* ``probe``: ``KVSlotMap.probe`` through that write, ``verify`` on the cache's last slot, restored;
* on the three ``KVCopier`` paths (``strided``: a slice copy per run of consecutive slots, the
  runner's for affine layouts on a CPU; ``indexed``: one gather and one scatter of every slot per
  view, the runner's for affine layouts on an accelerator; ``gather``: flat element gathers,
  forced): ``copy``, ``temperature`` (keys
  divided by 0.7), ``rotated`` (``copy_slots_rotated``) and ``read_keys``, moving ``copy_tokens``
  slots from a block offset of 5 to offsets 11 and 3; ``blocks``: ``read_blocks``,
  ``write_blocks``, ``copy_blocks``; the plan's ``cold_misses`` and ``warm_hits`` (below).

Times, reported and never judged (median of ``--repeats`` after a warm-up, synchronised on CUDA):
each copy on each path in GB/s of K/V payload (layers x tokens x 2 x heads x head_size x element
size, counted once), next to ``Tensor.copy_`` of as many contiguous bytes on the same device, and
their ratio; ``probe_ms``; a step's host-side plan for 8 isolated-mode requests of 8 chunks
(``ChunkCache.materialize`` of their prefills over ``NullDevice``: the scheduler's context plans
and the workers' fills, forwards and copies left out), cold (64 misses) and warm (hits).

It imports neither vLLM nor a graphchunk module that does (``tests/test_gpu_kv.py`` runs it with
``vllm`` unimportable). ``python perf/gpu/gpu_kv.py --quick``: CPU, CI sizes, seconds; without
``--quick``: CPU sizes, float32; ``--device cuda``: a lent GPU, bfloat16 by default. Writes JSON
to ``perf/results/gpu_kv.json`` (``--out``): device name, torch version, dtype, sizes, every
check, bandwidths, plan times. Exit status 1 when any check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # a lent machine runs a plain checkout: graphchunk is not installed there


def _hashlib_xxhash() -> str:
    """graphchunk's keys hash with ``xxhash``, which a lent GPU machine (torch, triton,
    transformers, no package index) lacks: there the plan's keys use a stand-in of the same
    interface over hashlib's blake2b (another hash, the same plan). Returns which one runs."""
    import importlib.util

    if importlib.util.find_spec("xxhash") is not None:
        return "xxhash"
    import hashlib
    import types

    class Hash:
        def __init__(self, data: bytes = b"", size: int = 16):
            self._h = hashlib.blake2b(bytes(data), digest_size=size)

        def update(self, data) -> None:
            self._h.update(bytes(data))

        def digest(self) -> bytes:
            return self._h.digest()

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    module = types.ModuleType("xxhash")
    module.xxh3_128 = Hash
    module.xxh3_128_digest = lambda data: Hash(data).digest()
    module.xxh3_64_hexdigest = lambda data: Hash(data, 8).hexdigest()
    sys.modules["xxhash"] = module
    return "hashlib.blake2b stand-in (xxhash is not installed)"


KEY_HASH = _hashlib_xxhash()

from graphchunk.blend.rope import KeyRotation  # noqa: E402
from graphchunk.cache.chunk_cache import ChunkCache, ScheduledPrompt  # noqa: E402
from graphchunk.cache.keys import KeySpace  # noqa: E402
from graphchunk.cache.kv_slots import KVCopier, KVSlotMap  # noqa: E402
from graphchunk.cache.pool import ChunkPool  # noqa: E402
from graphchunk.engine.request_args import ChunkRequest  # noqa: E402
from graphchunk.segments import split_at  # noqa: E402

LAYOUTS = {  # vLLM's KVCacheLayout: physical order of the logical axes [L, B, H, N, C], outermost first
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
TEMPERATURE = 0.7


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int
    heads: int
    head_size: int
    block_size: int
    copy_tokens: int  # >= 2


SIZES = {"quick": Sizes(2, 2, 32, 16, 100), "cpu": Sizes(8, 4, 128, 16, 2048),
         "cuda": Sizes(32, 8, 128, 16, 8192)}


def copy_slots_of(s: Sizes) -> tuple[np.ndarray, np.ndarray, int]:
    """Source slots from offset 5 of block 1, destinations in two halves from offsets 11 and 3 of
    later blocks (pool and request slots never overlap), and the blocks a cache needs (one spare:
    ``verify``'s slot)."""
    n, bs = s.copy_tokens, s.block_size
    src = np.arange(n) + bs + 5
    first = np.arange(n // 2) + (src[-1] // bs + 2) * bs + 11
    second = np.arange(n - n // 2) + (first[-1] // bs + 2) * bs + 3
    return src, np.concatenate([first, second]), int(second[-1]) // bs + 2


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping) -> None:
    """csrc/cache_kernels.cu's ``reshape_and_cache_flash`` for an unquantized cache, in torch:
    ``key_cache[slot // N, slot % N] = key[t]`` (V likewise) for each token ``t`` whose slot is not
    negative (padding), through the ``[B, N, H, D]`` views' strides, in place."""
    block_size, num_tokens = key_cache.shape[1], slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
    key_cache[blocks, offsets] = key[:num_tokens][valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:num_tokens][valid].to(value_cache.dtype)


def write_flash(key, value, kv_cache, slot_mapping) -> None:
    """A flash-style backend's ``do_kv_cache_update`` on a layer's ``[B, H, N, 2D]`` cache."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping)


def vllm_caches(layout: str, s: Sizes, num_blocks: int, dtype, device) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2D]`` views of one zeroed buffer laid out in ``layout``'s physical order."""
    order = LAYOUTS[layout]
    logical = (s.layers, num_blocks, s.heads, s.block_size, 2 * s.head_size)
    raw = torch.zeros([logical[d] for d in order], dtype=dtype, device=device)
    return list(raw.permute([order.index(d) for d in range(5)]).unbind(0))


def fill(caches: list[torch.Tensor], seed: int) -> None:
    """Random K/V at every slot of every layer, written through the reference."""
    device, (blocks, heads, bs, two_d) = caches[0].device, caches[0].shape
    generator = torch.Generator(device).manual_seed(seed)
    slots = torch.arange(blocks * bs, device=device)
    for cache in caches:
        key, value = (torch.randn(len(slots), heads, two_d // 2, generator=generator, device=device).to(cache.dtype)
                      for _ in range(2))
        write_flash(key, value, cache, slots)


def indices(slots: np.ndarray, bs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(slots // bs).to(device), torch.from_numpy(slots % bs).to(device)


def moved(caches: list[torch.Tensor], src, dst, key_fn) -> list[torch.Tensor]:
    """Every layer as it must be once ``src``'s K/V moved to ``dst`` (K through ``key_fn``), by logical indexing."""
    bs, d = caches[0].shape[2], caches[0].shape[3] // 2
    (sb, so), (db, do) = indices(src, bs, caches[0].device), indices(dst, bs, caches[0].device)
    want = []
    for cache in caches:
        target, kv = cache.clone(), cache[sb, :, so]  # [n, H, 2D]
        target[db, :, do, :d] = key_fn(kv[..., :d])
        target[db, :, do, d:] = kv[..., d:]
        want.append(target)
    return want


def logical_keys(cache: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    blocks, offsets = indices(slots, cache.shape[2], cache.device)
    return cache[blocks, :, offsets, : cache.shape[3] // 2]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def rotation(head_size: int) -> KeyRotation:
    angles = torch.arange(256.0)[:, None] * (1e-2 ** (torch.arange(0, head_size, 2) / head_size))[None]
    return KeyRotation(torch.cat([angles.cos(), angles.sin()], dim=-1), head_size, is_neox_style=True)


def check_write(cache: torch.Tensor) -> bool:
    """The reference puts token t's K/V at the logical view's ``[block, :, offset]`` and touches nothing else."""
    blocks, heads, bs, two_d = cache.shape
    slots = [3, bs + 7, blocks * bs - 2, -1]
    key, value = (torch.randn(4, heads, two_d // 2, device=cache.device).to(cache.dtype) for _ in range(2))
    write_flash(key, value, cache, torch.tensor(slots, device=cache.device))
    rest, ok = cache.clone(), True
    for t, slot in enumerate(slots[:3]):
        ok &= torch.equal(cache[slot // bs, :, slot % bs], torch.cat([key[t], value[t]], dim=-1))
        rest[slot // bs, :, slot % bs] = 0
    cache.zero_()
    return bool(ok) and not bool(rest.any())


def copy_ops(copier: KVCopier, src, dst, rot: KeyRotation) -> dict[str, tuple]:
    """Each copy timed and checked, with what it does to a source key."""
    deltas = np.arange(len(src)) % 7 + 190
    return {"copy": (lambda: copier.copy_slots(src, dst), lambda k: k),
            "temperature": (lambda: copier.copy_slots(src, dst, TEMPERATURE), lambda k: k / TEMPERATURE),
            "rotated": (lambda: copier.copy_slots_rotated(src, dst, deltas, rot),
                        lambda k: rot.rotate(k, torch.from_numpy(deltas)))}


def check_copies(copier: KVCopier, caches, src, dst, rot: KeyRotation) -> dict[str, bool]:
    """Each copy leaves every layer as the logical reference; then ``read_keys`` reads its keys."""
    checks = {}
    for name, (op, key_fn) in copy_ops(copier, src, dst, rot).items():
        want = moved(caches, src, dst, key_fn)
        op()
        checks[name] = same(caches, want)
    checks["read_keys"] = all(torch.equal(copier.read_keys(layer, slots), logical_keys(w, slots))
                              for layer, w in enumerate(want) for slots in (src, dst))
    return checks


def check_blocks(copier: KVCopier, caches: list[torch.Tensor]) -> bool:
    """Whole blocks of every layer out (host tensor), back in elsewhere, and copied."""
    want = [c.clone() for c in caches]
    data = copier.read_blocks([2, 5])
    ok = data.device.type == "cpu" and torch.equal(data, torch.stack([c[[2, 5]] for c in caches]).cpu())
    for w in want:
        w[[0, 3]] = w[[2, 5]]
    copier.write_blocks([0, 3], data)
    ok = ok and same(caches, want)
    for w in want:
        w[4] = w[1]
    copier.copy_blocks([1], [4])
    return ok and same(caches, want)


def seconds(fn, repeats: int, device) -> float:
    """Median wall time of ``fn`` after one warm-up, synchronised on CUDA."""
    sync, times = torch.cuda.synchronize if device.type == "cuda" else (lambda: None), []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def rate(seconds_: float, payload: int, torch_gb_s: float | None = None) -> dict:
    out = {"ms": seconds_ * 1e3, "gb_s": payload / seconds_ / 1e9}
    return out if torch_gb_s is None else {**out, "ratio_to_torch": out["gb_s"] / torch_gb_s}


def payload(s: Sizes, dtype) -> int:
    """Bytes of K/V a copy moves (counted once)."""
    return s.layers * s.copy_tokens * 2 * s.heads * s.head_size * dtype.itemsize


def torch_copy(s: Sizes, dtype, device, repeats: int) -> dict:
    a = torch.randn(payload(s, dtype) // dtype.itemsize, device=device).to(dtype)
    b = torch.empty_like(a)
    return {"bytes": payload(s, dtype), **rate(seconds(lambda: b.copy_(a), repeats, device), payload(s, dtype))}


def run_layout(layout: str, s: Sizes, dtype, device, repeats: int, torch_gb_s: float) -> dict:
    src, dst, num_blocks = copy_slots_of(s)
    caches = vllm_caches(layout, s, num_blocks, dtype, device)
    checks = {"write": check_write(caches[0])}
    start = time.perf_counter()
    try:
        slot_map = KVSlotMap.probe(write_flash, caches[0], 0, s.block_size, s.heads, s.head_size)
        slot_map.verify(write_flash, caches[0], num_blocks * s.block_size - 1)
        checks["probe"] = not bool(caches[0].any())  # the checked slot restored
    except RuntimeError as error:
        log(f"  {layout}: {error}")
        return {"checks": {**checks, "probe": False}}
    probe_ms = (time.perf_counter() - start) * 1e3
    fill(caches, seed=1)
    rot = rotation(s.head_size)
    copiers = {path: KVCopier(caches, slot_map, num_blocks, 0, gather=path == "indexed")
               for path in ("strided", "indexed", "gather")}
    copiers["gather"].views = None  # the flat-gather path (non-affine layouts'), forced
    for path, copier in copiers.items():
        checks.update({f"{path}/{k}": v for k, v in check_copies(copier, caches, src, dst, rot).items()})
    checks["blocks"] = check_blocks(copiers["strided"], caches)
    bandwidth = {f"{path}/{op}": rate(seconds(run_op, repeats, device), payload(s, dtype), torch_gb_s)
                 for path, copier in copiers.items() for op, (run_op, _) in copy_ops(copier, src, dst, rot).items()}
    return {"strides": list(caches[0].stride()), "strided_path": copiers["strided"].views is not None,
            "layers_in_one_view": copiers["strided"].layer_stride is not None, "probe_ms": probe_ms,
            "checks": checks, "bandwidth": bandwidth}


class NullDevice:
    """A ``KVDevice`` doing nothing: what is timed is the plan's own host work."""

    def prefill(self, seqs, num_layers=None): pass
    def copy_blocks(self, src_blocks, dst_blocks): pass
    def copy_slots(self, src_slots, dst_slots, key_temperature=1.0): pass
    def copy_slots_rotated(self, src_slots, dst_slots, deltas): pass


def plan_requests(num: int = 8, chunks: int = 8, sys_len: int = 64, question: int = 16) -> dict[str, ChunkRequest]:
    """``num`` isolated-mode requests sharing a sys prompt, each of ``chunks`` distinct chunks of 160 to 230 tokens."""
    requests, next_token = {}, 1000
    for r in range(num):
        lens = [sys_len, *(160 + 16 * ((r + c) % 5) + (r * c) % 7 for c in range(chunks)), question]
        ids = list(range(10, 10 + sys_len)) + list(range(next_token, next_token + sum(lens) - sys_len))
        next_token += sum(lens)
        seg = split_at(ids, np.cumsum(lens[:-1]).tolist(), max_chunks=chunks, max_chunk_len=256)
        requests[f"r{r}"] = ChunkRequest(seg, None, None)
    return requests


def time_plan(repeats: int, block_size: int = 16) -> dict:
    requests = plan_requests()
    tokens = {r: q.seg.layout.num_tokens for r, q in requests.items()}
    blocks = {r: list(range(i * 256, i * 256 + -(-n // block_size))) for i, (r, n) in enumerate(tokens.items())}

    def fresh() -> ChunkCache:
        return ChunkCache(ChunkPool(4096, block_size, first_block_id=1 << 16), KeySpace("gpu_kv", "bf16"), 8192)

    prompts = [ScheduledPrompt(q.seg, q.salt, 0, q.seg.layout.num_tokens, blocks[r]) for r, q in requests.items()]

    def step(cache: ChunkCache) -> float:
        start = time.perf_counter()
        cache.materialize(prompts, NullDevice())
        return time.perf_counter() - start

    caches = [fresh() for _ in range(repeats)]
    cold = [step(c) for c in caches]
    warm = [step(caches[0]) for _ in range(repeats)]
    chunks = sum(q.seg.layout.num_chunks for q in requests.values())
    metrics = caches[0].metrics
    return {"requests": len(requests), "chunks": chunks, "tokens": sum(tokens.values()),
            "cold_ms": statistics.median(cold) * 1e3, "warm_ms": statistics.median(warm) * 1e3,
            "checks": {"cold_misses": caches[-1].metrics.misses == chunks,
                       "warm_hits": (metrics.misses, metrics.hits) == (chunks, chunks * repeats)}}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--quick", action="store_true", help="CI sizes")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--repeats", type=int, help="timed repetitions (default 3 with --quick, else 10)")
    parser.add_argument("--out", type=Path, default=REPO / "perf/results/gpu_kv.json")
    return parser.parse_args(argv)


def log(line: str) -> None:
    print(line, flush=True)


def layout_line(layout: str, out: dict) -> str:
    failed = [name for name, ok in out["checks"].items() if not ok]
    speed = ", ".join(f"{k} {v['gb_s']:.2f} GB/s" for k, v in out.get("bandwidth", {}).items() if k.endswith("copy"))
    return (f"  {layout}: {len(out['checks']) - len(failed)}/{len(out['checks'])} checks passed"
            f"{' FAILED ' + ', '.join(failed) if failed else ''}; {speed}")


def run(s: Sizes, dtype, device, repeats: int) -> dict:
    result = {"device": device_name(device), "device_type": device.type, "torch": torch.__version__, "key_hash": KEY_HASH,
              "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "sizes": dataclasses.asdict(s)}
    log(f"gpu_kv: {result['device']} ({device}), torch {torch.__version__}, {result['dtype']}, {result['sizes']}")
    result["torch_copy"] = torch_copy(s, dtype, device, repeats)
    log(f"  torch copy of {payload(s, dtype) / 1e6:.1f} MB: {result['torch_copy']['gb_s']:.2f} GB/s")
    result["layouts"] = {}
    for layout in LAYOUTS:
        out = result["layouts"][layout] = run_layout(layout, s, dtype, device, repeats, result["torch_copy"]["gb_s"])
        log(layout_line(layout, out))
    plan = result["plan"] = time_plan(repeats)
    log(f"  plan of {plan['requests']} requests, {plan['chunks']} chunks: cold {plan['cold_ms']:.2f} ms, "
        f"warm {plan['warm_ms']:.2f} ms")
    checks = {f"{layout}/{name}": ok for layout, out in result["layouts"].items() for name, ok in out["checks"].items()}
    checks.update({f"plan/{name}": ok for name, ok in plan["checks"].items()})
    result["failed"] = [name for name, ok in checks.items() if not ok]
    result["passed"] = not result["failed"]
    return result


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kv: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    result = {"quick": args.quick, **run(SIZES["quick" if args.quick else device.type], dtype, device,
                                         args.repeats or (3 if args.quick else 10))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"gpu_kv: {'all checks passed' if result['passed'] else 'FAILED: ' + ', '.join(result['failed'])}; "
        f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
