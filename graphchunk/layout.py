"""Layout plan of a segmented prompt: roles, RoPE positions and token ranges (DESIGN.md §2).

The prompt's logical token order is ``sys ‖ c_1 ‖ ... ‖ c_k ‖ q``; slot mapping follows the
logical index, RoPE follows the position computed here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROLE_SYS, ROLE_CHUNK, ROLE_QUESTION = 0, 1, 2


@dataclass(frozen=True)
class Layout:
    """Segment lengths of one prompt: ``sys_len`` S, ``chunk_lens`` L_i, ``question_len`` Q."""

    sys_len: int
    chunk_lens: tuple[int, ...]
    question_len: int

    def __post_init__(self):
        if self.sys_len < 0 or self.question_len < 1 or any(n < 1 for n in self.chunk_lens):
            raise ValueError(f"invalid layout {self}: sys >= 0, every chunk >= 1, question >= 1")

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_lens)

    @property
    def max_chunk_len(self) -> int:
        """M: the chunks share positions [S, S+M)."""
        return max(self.chunk_lens, default=0)

    @property
    def context_len(self) -> int:
        """Logical tokens before the question: S + sum(L_i)."""
        return self.sys_len + sum(self.chunk_lens)

    @property
    def num_tokens(self) -> int:
        return self.context_len + self.question_len

    @property
    def question_position(self) -> int:
        """RoPE position of the first question token: S + M."""
        return self.sys_len + self.max_chunk_len

    @property
    def position_offset(self) -> int:
        """position - logical index for question and generated tokens: M - sum(L_i) (<= 0)."""
        return self.max_chunk_len - sum(self.chunk_lens)

    def chunk_starts(self) -> list[int]:
        """Logical index of each chunk's first token."""
        starts, at = [], self.sys_len
        for n in self.chunk_lens:
            starts.append(at)
            at += n
        return starts

    def segment_ids(self) -> np.ndarray:
        """Per logical token: 0 for sys, i for chunk i (1-based), k+1 for the question."""
        k = self.num_chunks
        ids = [np.zeros(self.sys_len, np.int64)]
        ids += [np.full(n, i + 1, np.int64) for i, n in enumerate(self.chunk_lens)]
        ids.append(np.full(self.question_len, k + 1, np.int64))
        return np.concatenate(ids)

    def roles(self) -> np.ndarray:
        seg = self.segment_ids()
        return np.where(seg == 0, ROLE_SYS, np.where(seg == self.num_chunks + 1, ROLE_QUESTION, ROLE_CHUNK))

    def positions(self, num_generated: int = 0) -> np.ndarray:
        """RoPE positions of the prompt tokens followed by ``num_generated`` decode tokens."""
        parts = [np.arange(self.sys_len)]
        parts += [np.arange(self.sys_len, self.sys_len + n) for n in self.chunk_lens]
        q0 = self.question_position
        parts.append(np.arange(q0, q0 + self.question_len + num_generated))
        return np.concatenate(parts).astype(np.int64)

    def attention_allowed(self, num_generated: int = 0) -> np.ndarray:
        """Boolean [T, T] matrix, True where query token i may attend key token j (vectorised).

        sys: causal within sys; a chunk token: sys + the earlier tokens of its own chunk;
        question and generated tokens: everything before them.
        """
        k = self.num_chunks
        qi, kj = self._query_key_segments(num_generated)
        causal = np.tril(np.ones((qi.size, qi.size), dtype=bool))
        return causal & ((kj == 0) | (kj == qi) | (qi == k + 1))

    def document_keys(self, num_generated: int = 0) -> np.ndarray:
        """Boolean [T, T]: True where a question or generated token (query) meets a chunk token (key),
        the attention isolated mode's corrections change (key temperature, APE's merge)."""
        k = self.num_chunks
        qi, kj = self._query_key_segments(num_generated)
        return (qi == k + 1) & (kj >= 1) & (kj <= k)

    def question_queries(self, num_generated: int = 0) -> np.ndarray:
        """Boolean [T, 1]: True for question and generated tokens."""
        return self._query_key_segments(num_generated)[0] == self.num_chunks + 1

    def logit_scale(self, key_temperature: float, num_generated: int = 0) -> np.ndarray:
        """Float [T, T] factor on attention logits (isolated mode's key temperature): 1 / T where a
        question or generated token attends a chunk token, 1 elsewhere (sys, own chunk, question)."""
        return np.where(self.document_keys(num_generated), 1.0 / key_temperature, 1.0)

    def _query_key_segments(self, num_generated: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment ids of the prompt and ``num_generated`` decode tokens (which belong to the
        question), as a query column [T, 1] and a key row [1, T]."""
        seg = np.concatenate([self.segment_ids(), np.full(num_generated, self.num_chunks + 1, np.int64)])
        return seg[:, None], seg[None, :]
