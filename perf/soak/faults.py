"""The soak's planted tier faults, and the canary requests that make the server read them.

A canary request sends two documents no trace request uses, behind its own system prompt; each
send has a question of another length, hence another layout and cache_salt, so vLLM's prefix
cache never serves it an earlier send's KV: graphchunk's pool or tier must. ``Faults``:

* ``restart(at_request, port)``: the canary writes its tier files; the server's incarnation ends
  (drained, leak gauges and /metrics read), it stops (SIGTERM); the largest file the canary wrote
  is truncated to half its size; a new server starts on the same port and tier directory; the
  canary is sent again (the server must reject the truncated file and recompute it);
* ``corrupt_live(at_request)``: while traffic runs, flips payload bytes in the canary's other file
  (else in the first listed tier file);
* ``check_live()``: after the traffic, the canary once more; ``exercised`` when the flipped bytes
  were still on disk and this send read them (the server removes or rewrites a file it rejects).

What happened is recorded in ``record`` (``restart``, ``live_corruption``: the result's
``faults``); every canary outcome is appended to ``tagged`` (checked against the oracle later).
"""
from __future__ import annotations

import random
from pathlib import Path

from perf.common.client import Outcome
from perf.common.server import Servers, delta, flip_payload_bytes, read_or_none, tier_files, truncate_file
from perf.common.trace import CANARY_SYS, Item


class Faults:
    """The faults of one soak pass (see the module docstring)."""

    def __init__(self, servers: Servers, store_root: Path, canary_docs: list[str], send, rng: random.Random,
                 tagged: list[Outcome], log=print):
        self.servers = servers
        self.store_root = store_root
        self.docs = tuple(canary_docs[:2])
        self.send = send
        self.rng = rng
        self.tagged = tagged
        self.log = log
        self.record: dict = {}
        self.live_planted: bytes | None = None

    def canary(self, send: int, tag: str) -> Outcome:
        """Send number ``send`` of the canary (documents in reverse order on odd sends)."""
        question = "Question: What do these documents describe?" + " Answer briefly." * send + "\nAnswer:"
        docs = self.docs if send % 2 == 0 else self.docs[::-1]
        outcome = self.send(Item(-1, CANARY_SYS.format(0), docs, question, False, tag=tag))
        self.tagged.append(outcome)
        return outcome

    def restart(self, at_request: int, port: int) -> None:
        """Canary, stop, truncate one canary tier file, start on the same port and directory,
        canary again."""
        servers = self.servers
        fault: dict = {"at_request": at_request}
        self.record["restart"] = fault
        before_files = set(tier_files(self.store_root))
        m0 = servers.metrics()
        fault["canary_status"] = self.canary(0, "canary-before-restart").status
        fault["canary_tier_writes"] = delta(servers.metrics(), m0, "vllm:graphchunk_tier_writes_total")
        servers.end_incarnation()
        self.log(f"[soak] restart at request {at_request}: stopping the server")
        fault["stop_exit_code"] = servers.stop()
        planted = self._truncate_canary_file(fault, before_files)
        servers.incarnation += 1
        servers.start(f"graphchunk-{servers.incarnation}", "graphchunk.Runner", self.store_root, port,
                      log_requests=True)
        fault["restarts"] = 1
        m1 = servers.metrics()
        fault["canary_again_status"] = self.canary(1, "canary-after-restart").status
        m2 = servers.metrics()
        fault["rejected_by_canary"] = delta(m2, m1, "vllm:graphchunk_tier_rejected_total")
        fault["tier_hits_by_canary"] = delta(m2, m1, "vllm:graphchunk_tier_hits_total")
        if fault["truncated"]:  # the server read the planted file iff it is gone or rewritten now
            fault["exercised"] = read_or_none(Path(fault["truncated"]["file"])) != planted

    def _truncate_canary_file(self, fault: dict, before_files: set[Path]) -> bytes | None:
        """Truncates the largest tier file the canary wrote (not in ``before_files``); its bytes now."""
        fresh = sorted(((size, str(p)) for p, size in tier_files(self.store_root).items() if p not in before_files),
                       reverse=True)
        fault["canary_files"] = [p for _, p in fresh]
        fault["truncated"] = None
        if not fresh:
            self.log("[soak] the canary wrote no tier file: no corruption planted at the restart")
            return None
        victim = Path(fresh[0][1])
        fault["truncated"] = {"file": str(victim), "to_bytes": truncate_file(victim), "from_bytes": fresh[0][0]}
        self.log(f"[soak] planted: truncated {victim.name} to half its size")
        return victim.read_bytes()

    def corrupt_live(self, at_request: int) -> None:
        """Flips payload bytes in the canary's other tier file while traffic runs."""
        fault = {"at_request": at_request}
        self.record["live_corruption"] = fault
        restart = self.record.get("restart", {})
        truncated = (restart.get("truncated") or {}).get("file")
        candidates = [Path(p) for p in restart.get("canary_files", []) if p != truncated and Path(p).exists()]
        if not candidates:  # no canary file: any file written before the restart
            candidates = sorted(tier_files(self.store_root))[:1]
            fault["target"] = "oldest listed tier file" if candidates else None
        else:
            fault["target"] = "canary file"
        if not candidates:
            self.log("[soak] no tier file to corrupt")
            return
        victim = candidates[0]
        fault["file"] = str(victim)
        fault["flipped_offsets"] = flip_payload_bytes(victim, self.rng)
        self.live_planted = victim.read_bytes()
        self.log(f"[soak] planted: flipped {len(fault['flipped_offsets'])} payload bytes in {victim.name}")

    def check_live(self) -> None:
        """After the traffic: the canary once more, if a live corruption was planted."""
        live = self.record.get("live_corruption")
        if not (live and live.get("file")):
            return
        victim = Path(live["file"])
        live["still_planted_before_canary"] = read_or_none(victim) == self.live_planted
        m1 = self.servers.metrics()
        again = self.canary(2, "canary-after-live-corruption")
        m2 = self.servers.metrics()
        live.update(canary_status=again.status,
                    rejected_by_canary=delta(m2, m1, "vllm:graphchunk_tier_rejected_total"),
                    rejected_total=m2.get("vllm:graphchunk_tier_rejected_total"),
                    misses_by_canary=delta(m2, m1, "vllm:graphchunk_misses_total"),
                    tier_hits_by_canary=delta(m2, m1, "vllm:graphchunk_tier_hits_total"))
        # Exercised when the planted bytes were still there and this send read them (the
        # server removes a corrupt file; an entry still in the pool never reaches the tier).
        # Only canary sends use the canary's documents, so no trace request read them first.
        live["exercised"] = bool(live["still_planted_before_canary"] and read_or_none(victim) != self.live_planted)
