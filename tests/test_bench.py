"""The bench command: prompt files in all three shapes (and clear errors for bad
lines), acceptance by depth, and the JSON a short real run writes."""

import json

import pytest

from mlx_eagle.bench import accepted_per_round, acceptance_by_depth, main, read_prompts
from mlx_eagle.errors import UserError


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_file_shapes(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        '{"id": "a", "category": "writing", "prompt": "Hi"}',
        '',
        '{"id": 7, "turns": ["First?", "Second?"]}',
        '{"id": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]}',
    ])
    a, b, c = read_prompts(path)
    assert (a.id, a.category, a.turns) == ("a", "writing", ["Hi"])
    assert (b.id, b.category, b.turns) == ("7", "all", ["First?", "Second?"])
    assert c.messages[1] == {"role": "user", "content": "Go"} and not c.turns


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "prompt": "Hi"', "p.jsonl:2: not valid JSON"),
    ('["Hi"]', "p.jsonl:2: expected a JSON object"),
    ('{"id": "a"}', "p.jsonl:2: give exactly one of"),
    ('{"id": "a", "prompt": "x", "turns": ["y"]}', "p.jsonl:2: give exactly one of"),
    ('{"id": "a", "turns": []}', "p.jsonl:2: 'turns' must be"),
    ('{"id": "a", "messages": [{"role": "user"}]}', r"p.jsonl:2: messages\[0\].content must be"),
    ('{"id": "a", "prompt": ""}', "p.jsonl:2: 'prompt' must be"),
])
def test_malformed_lines_name_the_line(tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", ['{"id": "ok", "prompt": "fine"}', line])
    with pytest.raises(UserError, match=message):
        read_prompts(path)


def test_rounds_are_read_from_the_stream():
    # prefill's token, then rounds of accepted drafts closed by the target's own token;
    # the last round stopped at end of sequence after two accepted drafts
    flags = [False, True, False, False, True, True, True, False, True, True]
    assert accepted_per_round(flags) == [1, 0, 3, 2]
    assert accepted_per_round([False, True, False]) == [1]


def test_acceptance_by_depth():
    # Rounds that accepted 0, 1, 3 and 2 draft tokens.
    assert acceptance_by_depth([0, 1, 3, 2]) == [3 / 4, 2 / 3, 1 / 2]
    assert acceptance_by_depth([]) == []


def test_a_short_run_writes_the_documented_json(tmp_path, smollm):
    from mlx_eagle.heads import new_head, save_head

    model, _ = smollm
    save_head(new_head(model, "eagle3", draft_vocab_size=2048, seed=0), tmp_path / "head")
    prompts = write_lines(tmp_path / "p.jsonl", [
        '{"id": "one", "category": "qa", "prompt": "What is 2 + 2?"}',
        '{"id": "two", "category": "chat", "turns": ["Say hi.", "Now say bye."]}',
    ])
    main(["--prompts", str(prompts), "--draft", str(tmp_path / "head"), "--max-tokens", "6",
          "--methods", "baseline,drafter", "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
          "--quiet"])
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results) >= {"methods", "prompts", "machine", "model", "head", "tree", "weights", "settings"}
    assert set(results["machine"]) >= {"platform", "device", "blas"}
    for name in ("baseline", "drafter"):
        summary = results["methods"][name]
        assert set(summary) >= {"tokens_per_s_median", "tokens_per_s_mean", "total_tokens", "tau",
                                "acceptance_by_depth", "peak_memory_gb", "speedup", "identical"}
        assert summary["identical"] is True  # greedy: every method's text is the baseline's
        assert [p["id"] for p in results["prompts"][name]] == ["one", "two"]
        assert {"category", "new_tokens", "seconds", "tau"} <= set(results["prompts"][name][0])
    assert results["methods"]["drafter"]["tau"] >= 1.0 and results["methods"]["baseline"]["tau"] is None
    assert (tmp_path / "r.png").stat().st_size > 0
