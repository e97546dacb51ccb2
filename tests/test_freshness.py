"""Whether a result measured graphchunk as it is now (``perf/common/freshness.py``), and the
README's numbers: every result file it cites measured today's code (or is listed as owing a
rerun, ``perf/freshness.json``'s ``pending``) and passed its own checks."""
from __future__ import annotations

from perf.common import freshness
from perf.common.harness import REPO

CODE = 'def f(x):\n    """Doubles."""\n    y = x * 2\n    return y\n'


def test_the_digest_follows_the_code_not_its_docstrings_comments_or_layout():
    same = {"a.py": 'def f(x):  # doubles\n    y = x*2\n    "an attribute docstring"\n    return y\n'}
    assert freshness.digest_of({"a.py": CODE}) == freshness.digest_of(same)
    assert freshness.digest_of({"a.py": CODE}) != freshness.digest_of({"a.py": CODE.replace("2", "3")})
    assert freshness.digest_of({"a.py": CODE}) != freshness.digest_of({"b.py": CODE})  # a module moved
    assert freshness.digest_of({"a.py": CODE}) != freshness.digest_of({"a.py": CODE, "b.py": "x = 1\n"})


def test_acknowledged_changes_chain_per_group():
    acks = {"acknowledged": [{"from": "A", "to": "B", "groups": ["serving"], "why": "."},
                             {"from": "B", "to": "C", "groups": ["serving", "soak"], "why": "."},
                             {"from": "X", "to": "A", "groups": ["soak"], "why": "."}], "pending": {}}
    assert freshness.holding("serving", "C", acks) == {"A", "B", "C"}
    assert freshness.holding("soak", "C", acks) == {"B", "C"}  # A -> B leaves soak results unacknowledged
    assert freshness.holding("serving", "B", acks) == {"A", "B"}  # an acknowledgement reaches forward only

    def result(code):
        return {"environment": {"graphchunk_code": code}}

    assert freshness.verdict(result("A"), "serving", "C", acks) == "current"
    assert freshness.verdict(result("A"), "soak", "C", acks) == "stale"
    assert freshness.verdict({"versions": {"graphchunk_code": "C"}}, "soak", "C", acks) == "current"
    assert freshness.verdict({}, "serving", "C", acks) == "unrecorded"


def test_a_page_citing_a_stale_or_failed_result_is_caught(tmp_path, monkeypatch):
    (tmp_path / "failed.json").write_text('{"checks_passed": false}')
    (tmp_path / "fine.json").write_text('{"checks": [{"passed": true}]}')
    (tmp_path / "named.json").write_text('{"checks": {"all_completed": true, "tier_hits": null, "hits": false}}')
    monkeypatch.setattr(freshness, "RESULTS", tmp_path)
    found = [("serving", [name], "cmd", "", [], code) for name, code in
             (("old.json", "stale"), ("owed.json", "pending"), ("failed.json", "current"), ("fine.json", "current"),
              ("nothing.json", "unrecorded"), ("other_old.json", "stale"), ("named.json", "current"))]
    page = "numbers from old.json, owed.json, failed.json, fine.json, named.json and nothing.json; not_other_old.json.bak"
    assert freshness.unfit_citations(page, found) == ["old.json: stale", "failed.json: its checks failed",
                                                      "nothing.json: unrecorded", "named.json: its checks failed"]


def test_every_result_the_readme_cites_measured_todays_code():
    bad = freshness.unfit_citations((REPO / "README.md").read_text())
    assert not bad, (f"README.md cites results that do not hold for today's code: {bad}; rerun them, or record why "
                     f"a change leaves them as they were (python -m perf.common.freshness --ack)")


def test_pending_reruns_name_result_files_that_exist():
    pending = freshness.load_acks()["pending"]
    assert all((freshness.RESULTS / name).exists() and why for name, why in pending.items()), pending
