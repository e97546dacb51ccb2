"""APE's correction of parallel encoding (Yang et al., ICLR 2025), as the HF oracle computes it.

For question and generated tokens of an isolated prompt, the keys they attend split in two parts:
the *tempered* part and the rest. Each part is its own softmax; the tempered part's logits are
divided by ``temperature`` T, and the two results are merged by their log-sum-exps, the tempered
part's multiplied by S·T (``scale`` S):

    out = w_t * softmax_t(l / T) @ V + w_r * softmax_r(l) @ V,
    (w_t, w_r) = softmax(S·T·lse_t(l / T), lse_r(l))

so the tempered part's total attention mass is raised to the power S·T. Which part is tempered
(``side``):

* ``"documents"``: the chunk tokens (DESIGN.md §2's reading: "the question's attention to the
  documents at temperature T");
* ``"prefix"``: the sys prompt and the question's own tokens, the documents plain: what APE's
  released code (``ape_llama.py``, ``*_attention_prefill_query``) computes, where the tempered
  softmax runs over ``cat(prefix, query)`` keys and the documents' is the other one.

T = S = 1 is isolated mode exactly (one softmax); with ``side="documents"`` and S·T = 1 it is one
softmax with the document logits divided by T (isolated mode's key temperature). Every other query
(sys and chunk tokens) attends as before. Stored keys and values never change.

Differences from APE's released code, on purpose: its documents' part runs ``causal=True`` in
flash-attention's bottom-right alignment, so during the question's own prefill the first question
tokens miss the last documents' keys; here every question token sees every document (what its decode
steps see, and what the method describes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SIDES = ("documents", "prefix")


@dataclass(frozen=True)
class Ape:
    temperature: float = 0.9
    scale: float = 0.9
    side: str = "documents"

    def __post_init__(self):
        if not (self.temperature > 0 and self.scale > 0):
            raise ValueError(f"APE needs temperature > 0 and scale > 0, got {self}")
        if self.side not in SIDES:
            raise ValueError(f"APE side {self.side!r}: one of {SIDES}")

    def tempered(self, layout, num_generated: int = 0) -> np.ndarray:
        """Boolean [T, T]: the keys of the tempered part for every query (none for sys and chunk
        queries); ``Layout.attention_allowed`` still decides what is attended at all."""
        documents = layout.document_keys(num_generated)
        if self.side == "documents":
            return documents
        return layout.question_queries(num_generated) & ~documents


def merged_attention(logits: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, tempered: torch.Tensor,
                     temperature: float, scale: float) -> torch.Tensor:
    """APE's merge: ``logits`` [..., q, k] (q.k times the model's scaling), ``values`` [..., k, d],
    ``allowed`` / ``tempered`` boolean, broadcastable to the logits. Rows with no tempered key get
    plain softmax attention over ``allowed``. Returns [..., q, d] in the values' dtype."""
    neg = torch.tensor(float("-inf"), dtype=torch.float32)
    logits = logits.float()
    scores = torch.where(allowed, torch.where(tempered, logits / temperature, logits), neg)
    lses = [torch.logsumexp(torch.where(part, scores, neg), dim=-1, keepdim=True) for part in (tempered, ~tempered)]
    # log of each part's share of the merged output, then every key's weight in one pass:
    # exp(score - lse_part + log share_part); a part with no key has lse -inf and share 0
    shares = torch.log_softmax(torch.cat([scale * temperature * lses[0], lses[1]], dim=-1), dim=-1)
    shift = [torch.where(torch.isfinite(lse), lse - share, 0.0) for lse, share in zip(lses, shares.split(1, dim=-1))]
    weights = torch.exp(scores - torch.where(tempered, shift[0], shift[1]))
    return (weights @ values.float()).to(values.dtype)
