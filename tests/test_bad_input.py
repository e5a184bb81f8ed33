"""Bad input rows: whatever a dataset holds, no row crashes the run; every bad row is skipped with exactly one
reason, counted, and listed (id, reason) in OUT/skipped.jsonl. Property-based (hypothesis) plus one end-to-end run.
"""

from __future__ import annotations

import json

import pytest
from conftest import demo_overrides
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dflash_prep.commands.extract import run_extraction
from dflash_prep.commands.inspect import check_output
from dflash_prep.data import rows as D
from dflash_prep.recipe.schema import load_recipe
from dflash_prep.target.model import load_tokenizer

REASONS = {v for k, v in vars(D).items() if k.startswith("SKIP_")}
VOCAB = 1024  # the demo model's vocab_size
MAX_LENGTH = 64
GOOD = {"messages": [{"role": "user", "content": "Is the cache warm?"},
                     {"role": "assistant", "content": "Yes, the cache is warm and the thread is fast."}]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(load_recipe(None).model)


def make_fn(tokenizer, overlong: str = "skip") -> D.Tokenizer:
    return D.Tokenizer(tokenizer=tokenizer, max_length=MAX_LENGTH, overlong=overlong, vocab_size=VOCAB)


# ---------------------------------------------------------------------------------------------- strategies
json_scalar = st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False) | st.text(max_size=12)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
roles = st.sampled_from(["system", "user", "assistant", "tool", "human", "gpt", "narrator", "", "USER", "function",
                         "function_call", "observation"])
block = st.fixed_dictionaries(  # Anthropic content blocks, well or badly formed
    {"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image", "redacted_thinking", "x"])},
    optional={"text": st.text(max_size=12) | json_value, "thinking": st.text(max_size=12), "id": json_value,
              "name": st.text(max_size=8) | json_value, "input": json_value, "tool_use_id": st.text(max_size=8),
              "content": st.text(max_size=12) | json_value})
content = st.text(max_size=60) | json_value | st.lists(block, max_size=3)
turn = st.dictionaries(st.sampled_from(["role", "content", "from", "value", "name", "weight", "tool_calls",
                                        "function_call", "reasoning_content"]), roles | content, max_size=4)
openai_turn = st.fixed_dictionaries({"role": roles | json_value, "content": content},
                                    optional={"weight": json_value, "function_call": json_value})
token_ids = st.lists(st.integers(-3, VOCAB + 3), max_size=MAX_LENGTH + 8)
row = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(openai_turn | turn, max_size=5) | json_value},
                          optional={"system": content, "tools": json_value, "functions": json_value}),
    st.fixed_dictionaries({"messages": st.lists(openai_turn | turn, max_size=5).map(json.dumps)}),
    st.fixed_dictionaries({"conversations": st.lists(turn, max_size=5) | json_value}),
    st.fixed_dictionaries({"input_ids": token_ids | json_value},
                          optional={"loss_mask": st.lists(st.integers(-1, 2), max_size=MAX_LENGTH + 8) | json_value}),
    st.dictionaries(st.sampled_from(["messages", "conversations", "input_ids", "loss_mask", "id", "text"]),
                    json_value, max_size=4),
    st.just(GOOD),
).flatmap(lambda r: st.fixed_dictionaries({}, optional={"id": json_value}).map(lambda extra: {**r, **extra}))


def check_kept(ids, mask) -> None:
    assert 2 <= len(ids) <= MAX_LENGTH and len(mask) == len(ids)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in ids)
    assert set(mask) <= {0, 1} and D.has_supervised_pair(mask)


# ---------------------------------------------------------------------------------------------- properties
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=row, overlong=st.sampled_from(["skip", "truncate"]))
def test_any_row_is_kept_valid_or_skipped_with_a_known_reason(tokenizer, r, overlong):
    ids, mask, reason = make_fn(tokenizer, overlong).tokenize_row(r)  # never raises
    event(reason or "kept")
    if reason:
        assert reason in REASONS and ids == [] and mask == []
    else:
        check_kept(ids, mask)
    if r is GOOD:
        assert not reason


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=row)
def test_any_row_is_kept_valid_or_skipped_with_a_known_reason_under_a_template_without_generation(tokenizer, r):
    """The located-span mask (no {% generation %} block): the same outcome set, never an exception."""
    template = tokenizer.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    fn = D.Tokenizer(tokenizer=tokenizer, max_length=MAX_LENGTH, overlong="truncate", vocab_size=VOCAB,
                     chat_template=template)
    ids, mask, reason = fn.tokenize_row(r)
    event(reason or "kept")
    if reason:
        assert reason in REASONS and ids == [] and mask == []
    else:
        check_kept(ids, mask)
    if r is GOOD:
        assert not reason


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(lines=st.lists(row.map(json.dumps) | st.text(max_size=30).filter(lambda t: t.strip() and "\n" not in t
                                                                        and "\r" not in t)
                      | st.sampled_from(["[1, 2]", "42", '"text"', "null", "{", "{'single': 'quotes'}"]),
                      min_size=1, max_size=12),
       good_at=st.integers(0, 12))
def test_a_jsonl_file_of_junk_loads_and_every_row_gets_one_outcome(tokenizer, tmp_path_factory, lines, good_at):
    """Through the real loader (datasets, or line by line when the file is not one Arrow table)."""
    lines = list(lines)
    lines.insert(min(good_at, len(lines)), json.dumps(GOOD))
    path = tmp_path_factory.mktemp("junk") / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    section = load_recipe(None, [f"data.path={path}", f"data.max_length={MAX_LENGTH}", "data.overlong=skip"]).data
    rows = D.load_rows(section)
    event("read line by line" if rows.column_names == [D.RAW_JSON_COLUMN] else "loaded as one table")
    result = D.tokenize_dataset(rows, tokenizer, section, VOCAB)
    assert result.num_rows == len(lines)
    kept = list(result.kept["sample_id"])
    skipped = {r["sample_id"]: r["reason"] for r in result.skipped_rows}
    assert len(kept) + len(skipped) == len(lines) and not set(kept) & set(skipped)
    assert set(kept) | set(skipped) == {f"{i:010d}" for i in range(len(lines))}
    assert set(skipped.values()) <= REASONS and sum(result.skipped_counts.values()) == len(skipped)
    assert f"{lines.index(json.dumps(GOOD)):010d}" in kept
    for ids, mask in zip(result.kept["input_ids"], result.kept["loss_mask"]):
        check_kept(list(ids), list(mask))


# ---------------------------------------------------------------------------------------------- end to end
BAD_ROWS = [  # (line, reason)
    ('{"id": "no-fields", "text": "hello"}', D.SKIP_NO_CONTENT_FIELD),
    ('{"id": "mistyped", "messages": "hello"}', D.SKIP_BAD_STRUCTURE),
    ('{"id": "missing-role", "messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}',
     D.SKIP_BAD_STRUCTURE),
    ('{"id": "empty", "messages": []}', D.SKIP_EMPTY),
    ('{"id": "role", "messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     D.SKIP_UNKNOWN_ROLE),
    ('{"id": "content", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}',
     D.SKIP_BAD_CONTENT),
    ('{"id": "no-assistant", "messages": [{"role": "user", "content": "anyone?"}]}', D.SKIP_NO_ASSISTANT),
    ('{"id": "oov", "input_ids": [1, 2, 3, 99999], "loss_mask": [1, 1, 1, 1]}', D.SKIP_OUT_OF_VOCAB),
    ('{"id": "negative", "input_ids": [1, -2, 3]}', D.SKIP_OUT_OF_VOCAB),
    ('{"id": "ids-type", "input_ids": [1, "two", 3]}', D.SKIP_BAD_TOKEN_IDS),
    ('{"id": "mask", "input_ids": [1, 2, 3], "loss_mask": [1, 1]}', D.SKIP_BAD_LOSS_MASK),
    ('{"id": "long", "input_ids": ' + json.dumps(list(range(1, 201))) + "}", D.SKIP_TOO_LONG),
    ('{"id": "short", "input_ids": [7]}', D.SKIP_TOO_SHORT),
    ("this line is not JSON", D.SKIP_INVALID_JSON),
    ("[1, 2, 3]", D.SKIP_NOT_AN_OBJECT),
]


def test_every_bad_row_is_skipped_listed_and_counted(tmp_path):
    good = [json.dumps({**GOOD, "id": f"good-{i}"}) for i in range(6)]
    lines = good[:3] + [line for line, _ in BAD_ROWS] + good[3:] + [json.dumps({"id": "pre", "input_ids": [5, 6, 7]})]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    summary = run_extraction(load_recipe(None, demo_overrides(out, **{
        "data.path": str(path), "data.max_length": 128, "data.overlong": "skip", "batching.num_workers": 0,
        "data.max_skipped_fraction": 1.0})))  # most rows here are bad on purpose
    expected = {f"{3 + i:010d}": reason for i, (_, reason) in enumerate(BAD_ROWS)}
    listed = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert {r["sample_id"]: r["reason"] for r in listed} == expected
    assert [r["source_id"] for r in listed[:13]] == [json.loads(line)["id"] for line, _ in BAD_ROWS[:13]]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_rows"] == len(lines) and manifest["num_skipped"] == len(BAD_ROWS)
    counts: dict[str, int] = {}
    for reason in expected.values():
        counts[reason] = counts.get(reason, 0) + 1
    assert manifest["skipped"] == summary["skipped"] == dict(sorted(counts.items()))
    assert manifest["num_samples"] == len(good) + 1 and manifest["num_failed"] == 0
    assert check_output(out) == []


def test_a_lone_surrogate_is_a_counted_skip_however_the_file_loads(tmp_path):
    """`"\\ud800"` alone (valid JSON, not encodable as UTF-8) in a file of plain rows and in one with a list of text
    parts beside it (a file that loads as one table, where pyarrow would drop the character and keep the row with
    its text changed): skipped as invalid_utf8 with its id both ways; a pair of surrogates (an emoji) is kept. An
    empty list of content parts is named as such, not as null."""
    plain = [json.dumps({**GOOD, "id": f"good-{i}"}) for i in range(4)]
    lone = '{"id": "lone", "messages": [{"role": "user", "content": "Hello \\ud800 world"}, ' \
           '{"role": "assistant", "content": "Fine, thanks."}]}'
    pair = '{"id": "emoji", "messages": [{"role": "user", "content": "Hi \\ud83d\\ude00"}, ' \
           '{"role": "assistant", "content": "Hello there."}]}'
    parts = json.dumps({"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                                    {"role": "assistant", "content": "Hello."}]})
    empty = json.dumps({"id": "empty-parts", "messages": [{"role": "user", "content": []},
                                                          {"role": "assistant", "content": "Hello."}]})
    for name, lines in {"plain": [*plain, lone, pair], "table": [*plain, parts, lone, pair, empty]}.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        out = tmp_path / f"out-{name}"
        run_extraction(load_recipe(None, demo_overrides(out, **{
            "data.path": str(path), "data.max_length": 128, "batching.num_workers": 0,
            "data.max_skipped_fraction": 1.0})))
        listed = {r["source_id"]: r for r in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
        assert listed["lone"]["reason"] == D.SKIP_INVALID_UTF8, (name, listed)
        assert "emoji" not in listed
        if name == "table":
            assert listed["empty-parts"]["detail"] == "turn 0 (user): `content` holds no text part"
            assert set(listed) == {"lone", "empty-parts"}
        else:
            assert set(listed) == {"lone"}


def test_the_tokenization_cache_key_follows_the_code_that_tokenizes(tokenizer):
    """datasets keys its map cache on a hash of the callable; the callable carries the sha256 of the source of the
    modules that tokenize (computed here independently from the files), so a changed module is a new key."""
    import hashlib
    from pathlib import Path

    from datasets.fingerprint import Hasher

    digest = hashlib.sha256()
    for path in sorted((Path(D.__file__).parent).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    fn = make_fn(tokenizer)
    assert fn.code_sha256 == digest.hexdigest()
    edited = make_fn(tokenizer)
    edited.code_sha256 = hashlib.sha256(b"another version of the modules").hexdigest()
    assert Hasher.hash(fn) == Hasher.hash(make_fn(tokenizer)) != Hasher.hash(edited)
