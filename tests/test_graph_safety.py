"""The graph-safety backend passes a graph-safe replay and fails each way a device graph would replay stale data."""
import pytest
import torch
from torch import nn

from graphchunk.graphs.graph_backends import CompileBackend, EagerBackend
from graphchunk.graphs.graph_safety import CheckedBackend, GraphSafetyError

N, MAX_TOKENS, VOCAB, HIDDEN, SLOTS = 4, 8, 32, 8, 16


class Toy(nn.Module):
    """Embedding + rotary-like table indexed by positions + Linear, writing a persistent KV cache at
    the slot mapping read from a forward context (as vLLM's attention reads its metadata)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("cos_sin", torch.randn(64, HIDDEN))
        self.kv_cache = torch.zeros(SLOTS, HIDDEN)
        self.context: dict[str, torch.Tensor] = {}

    def forward(self, input_ids, positions):
        hidden = self.proj(self.embed(input_ids) * self.cos_sin[positions])
        self.kv_cache.index_copy_(0, self.context["slot_mapping"], hidden)
        return hidden


class Step:
    """Persistent input buffers, written in place each step; the forward sees slices ``[:N]``."""

    def __init__(self, model: Toy):
        self.model = model
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long)
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.long)
        self.slots = torch.zeros(MAX_TOKENS, dtype=torch.long)

    def write(self, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        self.input_ids.copy_(torch.randint(0, VOCAB, (MAX_TOKENS,), generator=g))
        self.positions.copy_(torch.randint(0, 64, (MAX_TOKENS,), generator=g))
        self.slots.copy_(torch.randperm(SLOTS, generator=g)[:MAX_TOKENS])
        self.model.context["slot_mapping"] = self.slots[:N]
        return {"input_ids": self.input_ids[:N], "positions": self.positions[:N]}

    def context_reads(self) -> dict:
        return dict(self.model.context)


@pytest.fixture
def step():
    return Step(Toy())


def capture(step, inner=None):
    backend = CheckedBackend(inner or EagerBackend(), context_reads=step.context_reads)
    return backend.capture(step.model, step.write(0))


@pytest.mark.parametrize("inner", ["eager", "compile"])
def test_new_values_in_the_same_buffers_replay_as_eager(step, inner):
    # aot_eager: dynamo's guards and fail_on_recompile as in inductor, without the codegen (fast)
    backend = EagerBackend() if inner == "eager" else CompileBackend(1, compile_backend="aot_eager")
    with torch.inference_mode():
        template = capture(step, backend)
        for seed in (1, 2):
            inputs = step.write(seed)
            step.model.kv_cache.zero_()
            out = template.replay(**inputs).clone()
            cache = step.model.kv_cache.clone()
            step.model.kv_cache.zero_()
            expected = step.model(**inputs)
            assert torch.allclose(out, expected) and torch.allclose(cache, step.model.kv_cache)
            assert cache[step.slots[:N]].abs().sum() > 0  # the replay wrote the KV cache


def test_a_fresh_input_allocation_is_not_the_static_buffer(step):
    template = capture(step)
    inputs = step.write(1)
    inputs["positions"] = inputs["positions"].clone()  # same shape and values, other storage
    with pytest.raises(GraphSafetyError, match="input 'positions' reads a tensor that is not a static buffer") as err:
        template.replay(**inputs)
    assert "captured tensor at storage 0x" in str(err.value) and "now tensor at storage 0x" in str(err.value)


def test_a_replaced_module_buffer_names_the_op_reading_it(step):
    template = capture(step)
    step.model.cos_sin = step.model.cos_sin.clone()
    with pytest.raises(GraphSafetyError, match=r"op \d+ aten.index.Tensor argument 'self' reads a tensor that "
                                               "is not a static buffer it was captured with"):
        template.replay(**step.write(1))


def test_a_changed_host_scalar_is_a_value_baked_in_at_capture():
    holder, x = {"scale": 2.0}, torch.randn(3)
    template = CheckedBackend(EagerBackend()).capture(lambda x: x * holder["scale"], {"x": x})
    assert torch.equal(template.replay(x=x), x * 2.0)
    holder["scale"] = 3.0
    with pytest.raises(GraphSafetyError, match="op 0 aten.mul.Tensor argument 'other' differs from the host-side "
                                               "value baked in at capture: captured 2.0, now 3.0"):
        template.replay(x=x)


def test_a_host_sync_cannot_be_captured():
    def forward(x):
        return x * x.sum().item()

    host_sync = r"aten\.(item|_local_scalar_dense)\.default reads a device value on the host"
    with pytest.raises(GraphSafetyError, match=host_sync):
        CheckedBackend(EagerBackend()).capture(forward, {"x": torch.randn(3)})
    with pytest.raises(GraphSafetyError, match="aten.index.Tensor reads a device value on the host"):
        CheckedBackend(EagerBackend()).capture(lambda x: x[x > 0], {"x": torch.randn(3)})


def test_context_reads_keep_the_first_replays_buffers(step):
    template = capture(step)
    template.replay(**step.write(1))  # stands for the capture
    inputs = step.write(2)  # new slots written in place into the same buffer: fine
    template.replay(**inputs)
    assert torch.equal(step.model.kv_cache[step.slots[:N]], step.model(**inputs))
    step.model.context["slot_mapping"] = step.slots[:N].clone()
    with pytest.raises(GraphSafetyError, match="context read 'slot_mapping' is not the static buffer of the first "
                                               "replay: captured storage 0x"):
        template.replay(**inputs)


def test_context_reads_may_change_shape_but_not_keys():
    seq_lens, context, x = torch.zeros(8, dtype=torch.int32), {}, torch.randn(3)
    template = CheckedBackend(EagerBackend(), lambda: dict(context)).capture(lambda x: x + 1, {"x": x})
    for n in (4, 2, 8):  # requests per step vary within a bucket
        context["seq_lens"] = seq_lens[:n]
        template.replay(x=x)
    context["query_start_loc"] = seq_lens[:1]
    with pytest.raises(GraphSafetyError, match=r"context reads \['query_start_loc', 'seq_lens'\] differ"):
        template.replay(x=x)


def test_a_different_op_sequence_names_the_first_differing_index():
    flags, x = {"gelu": False}, torch.randn(3)

    def forward(x):
        y = x + 1
        return torch.nn.functional.gelu(y) if flags["gelu"] else torch.relu(y)

    template = CheckedBackend(EagerBackend()).capture(forward, {"x": x})
    template.replay(x=x)
    flags["gelu"] = True
    with pytest.raises(GraphSafetyError, match="op 1 differs: captured aten.relu.default with 1 arguments, now "
                                               "aten.gelu.default with 1: the replayed forward dispatches other ops"):
        template.replay(x=x)


def test_an_extra_op_at_the_end_is_a_different_op_count():
    flags, x = {"twice": False}, torch.randn(3)
    template = CheckedBackend(EagerBackend()).capture(lambda x: x * 2 * 2 if flags["twice"] else x * 2, {"x": x})
    flags["twice"] = True
    with pytest.raises(GraphSafetyError, match="op 1 differs: captured 1 ops, now 2"):
        template.replay(x=x)


def test_intermediates_and_their_views_are_internal():
    x = torch.randn(4, 4)

    def forward(x):  # fresh intermediates, viewed and written in place, read by later ops
        y = (x + 1).t()[1:]
        y.mul_(2)
        return y.sum(0) + torch.tensor([1.0, 2.0, 3.0, 4.0])

    template = CheckedBackend(EagerBackend()).capture(forward, {"x": x})
    for _ in range(3):
        assert torch.equal(template.replay(x=x), forward(x))
