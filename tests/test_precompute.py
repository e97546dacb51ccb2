"""``graphchunk-precompute``'s corpus reading and its errors (the run itself: tests/test_tier.py)."""
import json

import pytest

from graphchunk.tools.precompute import main, make_parser, precompute, read_corpus


def write(tmp_path, lines):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def texts(*values) -> list[dict]:
    return [{"text": value} for value in values]


def test_groups_by_sys_and_mode_in_file_order_once_each(tmp_path):
    path = write(tmp_path, [{"text": "a"}, {"text": "b", "mode": "blend"}, "", {"text": "a"},
                            {"text": "c", "sys": "other"}, {"text": "d"}])
    assert read_corpus(path, "S", "isolated") == {("S", "isolated"): texts("a", "d"), ("S", "blend"): texts("b"),
                                                  ("other", "isolated"): texts("c")}


def test_documents_lines_carry_their_fields_and_segments_refuses_them(tmp_path):
    titled = {"title": "T", "text": "a"}
    path = write(tmp_path, [{"document": titled}, {"text": "a"}, {"document": {"text": "a"}}, {"document": titled}])
    assert read_corpus(path, "S", "isolated") == {("S", "isolated"): [titled, {"text": "a"}]}
    with pytest.raises(ValueError, match="docs.jsonl:1: --format segments sends a document's text only"):
        read_corpus(path, "S", "isolated", text_only=True)


@pytest.mark.parametrize("line, message", [
    ("{not json", "docs.jsonl:2: not JSON"),
    ({"txt": "a"}, "docs.jsonl:2: each line needs a non-empty string 'text' or a 'document' object"),
    ({"text": "a", "document": {"text": "b"}}, "not both"),
    ({"text": ""}, "docs.jsonl:2: document 1 is empty"),
    ({"text": 3}, "document 1's 'text' must be a string"),
    ({"document": {"text": "a", "meta": {"page": 1}}}, "document 1's 'meta' must be a string"),
    ({"document": ["a"]}, "document 1 must be a non-empty object of strings"),
    ({"text": "a", "mode": "fast"}, "'mode' one of auto, isolated, blend"),
    ({"text": "a", "sys": 3}, "'sys' must be a string"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        read_corpus(write(tmp_path, [{"text": "ok"}, line]), "", "isolated")


def test_cli_refuses_bad_input_before_starting_an_engine(tmp_path, capsys):
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(write(tmp_path, ["{bad"]))]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(write(tmp_path, [""]))]) == 2
    assert "holds no documents" in capsys.readouterr().err
    assert main(["--store", str(tmp_path / "s"), "--corpus", str(tmp_path / "missing.jsonl")]) == 2


def test_mode_auto_leaves_the_mode_to_the_engine(tmp_path):
    """The default --mode is 'auto': its documents' requests name no mode, so they run in the
    engine's default mode, as a server's with the same settings do; a named mode is sent."""
    assert make_parser().parse_args(["--store", "s", "--corpus", "c"]).mode == "auto"
    groups = read_corpus(write(tmp_path, [{"text": "a"}, {"text": "b", "mode": "isolated"}]), "S", "auto")

    class Engine:
        def __init__(self):
            self.sent = []

        def stats(self):
            return dict.fromkeys(("tier_writes", "tier_bytes_written", "tier_hits", "tier_rejected",
                                  "tier_write_errors", "misses"), 0)

        def generate(self, prompts, params, use_tqdm):
            self.sent += [(p.chunks[0], params.extra_args) for p in prompts]

    engine = Engine()
    assert precompute(engine, groups, documents=False, progress=False)["documents"] == 2
    assert engine.sent == [("a", None), ("b", {"graphchunk_mode": "isolated"})]
