import numpy as np
import pytest

from graphchunk.layout import ROLE_CHUNK, ROLE_QUESTION, ROLE_SYS, Layout


def test_positions_follow_design():
    lay = Layout(sys_len=3, chunk_lens=(4, 2), question_len=2)
    assert lay.positions().tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 7, 8]
    assert lay.positions(num_generated=2).tolist()[-4:] == [7, 8, 9, 10]
    assert lay.question_position == 7 and lay.position_offset == 4 - 6
    # Decode: position = logical index + offset.
    assert lay.num_tokens + lay.position_offset == lay.positions(1)[-1]
    assert lay.roles().tolist() == [ROLE_SYS] * 3 + [ROLE_CHUNK] * 6 + [ROLE_QUESTION] * 2


def test_attention_allowed_is_the_isolated_mask():
    lay = Layout(sys_len=1, chunk_lens=(2, 1), question_len=1)
    expected = np.array([
        [1, 0, 0, 0, 0],  # sys
        [1, 1, 0, 0, 0],  # c1 t0
        [1, 1, 1, 0, 0],  # c1 t1
        [1, 0, 0, 1, 0],  # c2: sys + itself, not c1
        [1, 1, 1, 1, 1],  # question: everything
    ], dtype=bool)
    assert (lay.attention_allowed() == expected).all()
    gen = lay.attention_allowed(num_generated=1)
    assert gen[-1].all() and not gen[:-1, -1].any()


def test_no_chunks_is_plain_causal():
    lay = Layout(sys_len=3, chunk_lens=(), question_len=4)
    assert (lay.attention_allowed() == np.tril(np.ones((7, 7), bool))).all()
    assert lay.positions().tolist() == list(range(7))


@pytest.mark.parametrize("args", [(-1, (1,), 1), (0, (0,), 1), (0, (1,), 0)])
def test_invalid_layouts(args):
    with pytest.raises(ValueError):
        Layout(*args)
