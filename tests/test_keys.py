from graphchunk.cache.keys import KeySpace, chunk_key, sys_key

SPACE = KeySpace(model="smollm2", dtype="float32")


def test_key_depends_on_every_component():
    base = chunk_key(SPACE, [1, 2], [3, 4], "tenant-a")
    variants = [
        chunk_key(KeySpace("other", "float32"), [1, 2], [3, 4], "tenant-a"),
        chunk_key(KeySpace("smollm2", "bfloat16"), [1, 2], [3, 4], "tenant-a"),
        chunk_key(KeySpace("smollm2", "float32", "tp2-pp1"), [1, 2], [3, 4], "tenant-a"),
        chunk_key(SPACE, [1, 9], [3, 4], "tenant-a"),
        chunk_key(SPACE, [1, 2], [3, 5], "tenant-a"),
        chunk_key(SPACE, [1, 2], [3, 4], "tenant-b"),
        chunk_key(SPACE, [1, 2], [3, 4]),
        chunk_key(SPACE, [1], [2, 3, 4], "tenant-a"),  # boundary slides: must differ
        sys_key(SPACE, [1, 2, 3, 4], "tenant-a"),
    ]
    assert len(base) == 16
    assert all(v != base for v in variants)
    assert len(set(variants)) == len(variants)


def test_key_is_deterministic():
    assert chunk_key(SPACE, (1, 2), (3,)) == chunk_key(SPACE, [1, 2], [3])
