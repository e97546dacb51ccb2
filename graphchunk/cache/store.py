"""The persistent chunk tier: pool entries' KV in a directory below the device pool.

A pool miss asks the tier before computing; an entry computed into the pool is written through
to it, so a restarted server, another server on the same directory (a shared filesystem) or
``graphchunk-precompute`` run before the deployment find it there. One file per entry:

    b"GCKV" | format version (u32) | header length (u32) | header (JSON) | payload | digest (128 bits)

The header names everything that decides whether the bytes are this engine's KV: graphchunk's
format version, the model (path, and a digest of its weights' metadata: two copies of the same
weights at different paths share files, different weights at one path do not), the KV cache
dtype and per-layer layout (shape without the block dimension, backend, in-block layout), block
size, parallel layout and rank, mode, key and tokens, and for a blend entry that
``graphchunk-precompute --context`` computed behind the operator's context documents, that
context's identity (``context``: informational; the entry is served wherever its chunk is). The payload is the entry's whole blocks in
every layer ([layers, blocks, *block]); the digest covers header and payload. It is xxh3-128 (it
catches a torn or corrupt file, not a forged one), or with a store key (``store_key_file``) a
keyed BLAKE2b MAC: a server with a key serves only files made with that key, and one without
serves no keyed file (the header says ``"mac": "keyed"``).

A file is written to a temporary name in its directory and renamed over the final name
(``os.replace`` is atomic on POSIX filesystems), so concurrent writers of one entry each leave a
complete file and a reader never sees a torn one. A file that is truncated or corrupt is
removed; one from another model, dtype, layout or format version is ignored (it may be another
server's); an unreadable one is skipped; each is counted (``tier_rejected``) and logged, and the
entry is computed instead. Files are named by the content key, which covers ``cache_salt``.

The tier's budget (``store_bytes``) is enforced by whichever server writes: oldest modification
time first (a hit touches its file), over the whole directory, so servers sharing it share one
budget. Writes are synchronous within the step. The workers reach the directory through
``tier.Tier``, which puts the host-memory level (``host_bytes``) in front of it and joins
tensor-parallel ranks' answers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import xxhash

from graphchunk.config import ConfigError
from graphchunk.log import logger
from graphchunk.metrics import CacheMetrics


MAGIC = b"GCKV"
FORMAT_VERSION = 1
SUFFIX = ".gckv"
_PREAMBLE = struct.Struct("<4sII")
_DIGEST = 16
_STALE_TMP_SECONDS = 600
_RESCAN_WRITES = 64


class RejectedFile(Exception):
    """A tier file that must not be served; ``corrupt`` ones are removed."""

    def __init__(self, reason: str, corrupt: bool):
        super().__init__(reason)
        self.corrupt = corrupt


@dataclass(frozen=True)
class StoreIdentity:
    """What a file's KV must have been computed under to be served by this engine."""

    model_path: str
    weights_digest: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    parallel: str
    """Parallel layout and this rank, e.g. ``tp2-pp1 rank 1``."""

    def mismatch(self, header: dict) -> str | None:
        """Why a header's engine is not this one (``model_path`` is informational), else None."""
        theirs = header.get("engine", {})
        for name, mine in dataclasses.asdict(self).items():
            if name != "model_path" and theirs.get(name) != mine:
                return f"{name} is {theirs.get(name)!r}, this engine's is {mine!r}"
        return None


class ChunkStore:
    def __init__(self, path: str | Path, budget_bytes: int, identity: StoreIdentity, num_layers: int,
                 block_shape: Sequence[int], metrics: CacheMetrics | None = None, mac_key: bytes | None = None):
        """``block_shape``: one block of one layer's KV cache, as ``KVCopier.read_blocks`` gives it.
        ``mac_key``: the deployment's store key (``read_store_key``), None for unkeyed files."""
        self.root = Path(path)
        self.mac_key = mac_key
        self.num_layers = num_layers
        self.block_shape = list(block_shape)
        self.budget = budget_bytes
        self.identity = identity
        self.metrics = metrics or CacheMetrics()
        self.rank_tag = identity.parallel.split()[-1]
        prepare_directory(self.root)
        self._writes_since_scan = 0
        self._scan()

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}-r{self.rank_tag}{SUFFIX}"

    # --- read ---------------------------------------------------------------------------------

    def load(self, key: bytes, tokens: Sequence[int], mode: str, num_blocks: int) -> torch.Tensor | None:
        """The entry's payload [layers, blocks, *block] from its file, or None (no file, or one not
        servable)."""
        path = self.path_of(key)
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                raw = _read_all(f)
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._reject(path, RejectedFile(f"unreadable: {exc}", corrupt=False), None)
            return None
        try:
            header, payload = self._parse(raw)
            reason = self.identity.mismatch(header)
            if reason is None and (header["key"] != key.hex() or header["mode"] != mode
                                   or header["tokens"] != list(tokens)):
                reason = "written for another key, mode or token sequence"
            expected = [self.num_layers, num_blocks, *self.block_shape]
            if reason is None and (header["payload_shape"] != expected or header["payload_dtype"] != self.identity.kv_dtype):
                reason = (f"payload {header['payload_dtype']} {header['payload_shape']}, this entry needs "
                          f"{self.identity.kv_dtype} {expected}")
            if reason:
                raise RejectedFile(reason, corrupt=False)
            data = _tensor(payload, header["payload_dtype"], header["payload_shape"])
        except RejectedFile as exc:
            self._reject(path, exc, inode)
            return None
        _touch(path)
        self.metrics.tier_bytes_read += len(raw)
        self.metrics.tier_read_seconds += time.perf_counter() - start
        return data

    def _parse(self, raw: bytearray) -> tuple[dict, memoryview]:
        if len(raw) < _PREAMBLE.size + _DIGEST:
            raise RejectedFile(f"truncated: {len(raw)} bytes", corrupt=True)
        magic, version, header_len = _PREAMBLE.unpack_from(raw)
        if magic != MAGIC:
            raise RejectedFile("not a graphchunk tier file (bad magic)", corrupt=True)
        if version != FORMAT_VERSION:
            raise RejectedFile(f"format version {version}, this graphchunk reads {FORMAT_VERSION}", corrupt=False)
        body_end = len(raw) - _DIGEST
        if _PREAMBLE.size + header_len > body_end:
            raise RejectedFile(f"truncated: {len(raw)} bytes, header alone needs {header_len}", corrupt=True)
        if self._digest(memoryview(raw)[_PREAMBLE.size:body_end]) != raw[body_end:]:
            raise self._mismatch(raw, header_len)
        try:
            header = json.loads(raw[_PREAMBLE.size:_PREAMBLE.size + header_len])
        except ValueError as exc:
            raise RejectedFile(f"unreadable header: {exc}", corrupt=True) from None
        payload = memoryview(raw)[_PREAMBLE.size + header_len:body_end]
        if len(payload) != header.get("payload_bytes"):
            raise RejectedFile(f"payload of {len(payload)} bytes, header says {header.get('payload_bytes')}",
                               corrupt=True)
        return header, payload

    def _digest(self, *parts) -> bytes:
        """xxh3-128 of ``parts``, or with a store key their keyed BLAKE2b (128 bits)."""
        digest = xxhash.xxh3_128() if self.mac_key is None else hashlib.blake2b(key=self.mac_key, digest_size=_DIGEST)
        for part in parts:
            digest.update(part)
        return digest.digest()

    def _mismatch(self, raw: bytearray, header_len: int) -> RejectedFile:
        """Why a file's digest does not match: corrupt (removed), or made with another key or none
        (ignored: it may be another deployment's), as far as its unverified header says."""
        if self.mac_key is not None:
            return RejectedFile("not made with this deployment's store key (store_key_file): another key's, "
                                "an unkeyed or forged file, or a corrupt one", corrupt=False)
        try:
            keyed = json.loads(raw[_PREAMBLE.size:_PREAMBLE.size + header_len]).get("mac") == "keyed"
        except (ValueError, AttributeError):
            keyed = False
        if keyed:
            return RejectedFile("made with a store key, and this server has none (store_key_file)", corrupt=False)
        return RejectedFile("checksum mismatch (truncated or corrupt)", corrupt=True)

    def _reject(self, path: Path, exc: RejectedFile, inode: int | None) -> None:
        self.metrics.tier_rejected += 1
        action = "ignored"
        if exc.corrupt and inode is not None:
            try:  # unless another writer has replaced it with a good file meanwhile
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
                    action = "removed"
            except OSError:
                pass
        logger.warning("graphchunk: tier file %s not served (%s), %s; computing the entry instead", path, exc, action)

    # --- write --------------------------------------------------------------------------------

    def save(self, key: bytes, tokens: Sequence[int], num_tokens: int, mode: str, data: torch.Tensor,
             context: str | None = None) -> None:
        """Writes an entry's payload atomically; a failure is logged and counted, never raised.
        ``context``: what a contextualized blend entry was computed behind (``context_identity``)."""
        start = time.perf_counter()
        path = self.path_of(key)
        payload = data.contiguous().view(torch.uint8).numpy().reshape(-1)  # a view: written without a copy
        header = json.dumps({
            "format": FORMAT_VERSION, "engine": dataclasses.asdict(self.identity), "key": key.hex(), "mode": mode,
            "tokens": list(map(int, tokens)), "num_tokens": num_tokens, "payload_dtype": str(data.dtype),
            "payload_shape": list(data.shape), "payload_bytes": len(payload), "written_by": os.getpid(),
            **({"context": context} if context is not None else {}),
            **({"mac": "keyed"} if self.mac_key is not None else {}),
        }, separators=(",", ":")).encode()
        digest = self._digest(header, payload)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)))
                f.write(header)
                f.write(payload)
                f.write(digest)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            self.metrics.tier_write_errors += 1
            logger.warning("graphchunk: could not write tier file %s: %s", path, exc)
            _unlink(tmp)
            return
        size = _PREAMBLE.size + len(header) + len(payload) + _DIGEST
        self.metrics.tier_writes += 1
        self.metrics.tier_bytes_written += size
        self.metrics.tier_write_seconds += time.perf_counter() - start
        self.metrics.tier_bytes += size
        self._writes_since_scan += 1
        if self.metrics.tier_bytes > self.budget or self._writes_since_scan >= _RESCAN_WRITES:
            self._scan()

    # --- budget -------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Recounts the directory (other servers write to it too); over budget, removes the
        least recently used files down to 90 % of it; removes temporary files left by crashes."""
        self._writes_since_scan = 0
        files, total, now = [], 0, time.time()
        for path in self.root.rglob("*"):
            try:
                stat = path.stat()
            except OSError:
                continue
            if path.name.endswith(".tmp") and now - stat.st_mtime > _STALE_TMP_SECONDS:
                _unlink(path)
            elif path.suffix == SUFFIX and path.is_file():
                files.append((stat.st_mtime, stat.st_size, path))
                total += stat.st_size
        if total > self.budget:
            files.sort()
            target = int(self.budget * 0.9)
            for _, size, path in files:
                if total <= target:
                    break
                if _unlink(path):
                    total -= size
                    self.metrics.tier_evictions += 1
        self.metrics.tier_bytes = total


def prepare_directory(path: str | Path) -> None:
    """Creates the tier directory and checks it is writable, or raises ConfigError."""
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{uuid.uuid4().hex[:12]}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"graphchunk.store_path={str(path)!r} is not a writable directory: {exc}") from None


def read_store_key(path: str) -> bytes:
    """The deployment's store key from the file ``path`` (``store_key_file``): a BLAKE2b key derived
    from its bytes, at least 16 of them. Raises ConfigError naming the setting."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"graphchunk.store_key_file={path!r} cannot be read: {exc}") from None
    if len(secret) < 16:
        raise ConfigError(f"graphchunk.store_key_file={path!r} holds {len(secret)} bytes; a store key needs "
                          "at least 16 (e.g. head -c 32 /dev/urandom > FILE)")
    return hashlib.blake2b(secret, digest_size=32).digest()


def weights_digest(model: str, revision: str | None = None) -> str:
    """A digest of the model's weights' metadata: every weight file's name and size, and the
    tensor table (names, dtypes, shapes, offsets) of safetensors files, plus config.json.
    Raises ConfigError when the weights are not on local disk."""
    root = Path(model)
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure means: not on local disk
            raise ConfigError(f"graphchunk.store_path needs the model's weights on local disk to identify "
                              f"them; {model!r} is not a local directory ({exc})") from None
    h = xxhash.xxh3_128()
    weights = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    if not weights:
        raise ConfigError(f"graphchunk.store_path: no weight files in {root}")
    for p in [root / "config.json", *weights]:
        if not p.exists():
            continue
        h.update(f"{p.name}\x1f{p.stat().st_size}\x1e".encode())
        with open(p, "rb") as f:
            if p.suffix == ".safetensors":
                (length,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(length))
            elif p.name == "config.json":
                h.update(f.read())
    return h.hexdigest()


def _tensor(payload: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise RejectedFile(f"unknown payload dtype {dtype!r}", corrupt=False)
    # A view of the file's buffer (one copy, the read); the tensor keeps the buffer alive.
    data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    try:
        return data.view(torch_dtype).reshape(shape)
    except RuntimeError as exc:
        raise RejectedFile(f"payload does not fit shape {shape}: {exc}", corrupt=True) from None


def _read_all(f) -> bytearray:
    """The whole open file into a writable buffer (what ``torch.frombuffer`` views without a copy)."""
    raw = bytearray(os.fstat(f.fileno()).st_size)
    del raw[f.readinto(raw):]  # in place: a file shorter than its size is cut, not copied
    return raw


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
