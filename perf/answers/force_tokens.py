"""Teacher forcing inside one vLLM request: a vLLM v1 logits processor.

    LLM(..., logits_processors=[ForceTokens])
    SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1,
                   extra_args={"force_tokens": [t_0, ..., t_{n-1}]})

At generation step j of a request whose ``extra_args`` carry ``force_tokens``, every logit but
``t_j``'s is set to -inf, so the request is fed exactly ``t_0..t_{n-1}``. vLLM 0.32's returned
sample logprobs are computed *before* logits processors run (``logprobs_mode="raw_logprobs"``, the
default: ``Sampler.forward`` takes ``compute_logprobs(logits)`` ahead of
``apply_logits_processors``), so with ``logprobs=1`` each step's logprobs hold the forced token
(with its rank under the model's own distribution) and the model's own top-1 (rank 1).
Requests without the key are left alone. The step index is the length of the request's running
output-token list (a live reference handed over in ``BatchUpdate.added``).
"""
from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

KEY = "force_tokens"


class ForceTokens(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        forced = (sampling_params.extra_args or {}).get(KEY)
        if forced is None:
            return
        if not isinstance(forced, list) or not forced or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forced):
            raise ValueError(f"extra_args[{KEY!r}] must be a non-empty list of token ids, got {forced!r}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch index -> (forced token ids, the request's running output token ids)
        self.forced: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _prompt_ids, output_ids: list[int]):
            forced = (params.extra_args or {}).get(KEY) if params is not None else None
            return (forced, output_ids) if forced else None

        process_dict_updates(self.forced, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output_ids) in self.forced.items():
            step = len(output_ids)
            if step < len(forced):
                row = logits[index]
                row.fill_(float("-inf"))
                row[forced[step]] = 0.0
        return logits
