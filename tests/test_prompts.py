"""Prompt sets: training prompts never come from evaluation sets, and built sets are stable."""

import gzip
import json

import pytest

from dspark_trt import DsparkError
from dspark_trt.training.prompts import (
    DATA_DIR,
    EVALUATION_SETS,
    FOLLOW_UPS,
    TRAINING_SETS,
    follow_up_prompts,
    load_prompts,
    resample_prompts,
)


def first_user_text(prompt) -> str:
    return next(m["content"] for m in prompt.messages if m["role"] == "user")


def test_training_sets_share_no_prompt_with_evaluation_sets():
    training = {first_user_text(p) for name in TRAINING_SETS for p in load_prompts(name)}
    evaluation = {first_user_text(p) for name in EVALUATION_SETS for p in load_prompts(name)}
    assert len(training) > 10_000 and len(evaluation) > 1_000
    assert not training & evaluation


def test_completion_prompts_are_stdlib_stubs_not_humaneval_tasks():
    prompts = load_prompts("code-stdlib-complete")
    again = load_prompts("code-stdlib-complete")
    assert [first_user_text(p) for p in prompts] == [first_user_text(p) for p in again]  # same ids, same text
    assert len(prompts) > 300 and {p.domain for p in prompts} == {"code"}
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f]
    for prompt in prompts:
        text = first_user_text(prompt)
        assert text.startswith("Complete the following Python function.\n\n```python\ndef ")
        assert '"""' in text and " at 0x" not in text  # a docstring; no run-dependent default values
        def_line = text.split("```python\n", 1)[1].split("\n", 1)[0]  # "def name(signature):"
        assert not any(def_line in task for task in humaneval)  # a name may recur (search), never a task


def test_the_extra_stdlib_sets_are_stable_new_tasks_whose_stubs_parse():
    """`code-stdlib-extra(-complete)`: the rest of the stdlib (other modules' functions, every
    class's methods), built the same way in every run, none a task the first code sets already
    ask, and every completion stub valid Python (a def, or a class holding the one method)."""
    import ast

    write, complete = load_prompts("code-stdlib-extra"), load_prompts("code-stdlib-extra-complete")
    assert [first_user_text(p) for p in write] == [first_user_text(p) for p in load_prompts("code-stdlib-extra")]
    assert len(write) == len(complete) > 1_000 and {p.domain for p in write + complete} == {"code"}
    earlier = {first_user_text(p) for name in ("code-stdlib", "code-stdlib-complete") for p in load_prompts(name)}
    overlap = earlier & {first_user_text(p) for p in write + complete}
    assert not overlap, sorted(overlap)[:3]
    methods = [p for p in write if first_user_text(p).startswith("Write the method `")]
    assert methods and len(methods) < len(write)  # both functions and methods
    for prompt in complete:
        text = first_user_text(prompt)
        assert " at 0x" not in text
        stub = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
        tree = ast.parse(stub)  # a signature and docstring that Python accepts
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.ClassDef))


def test_the_extra_stdlib_sets_do_not_depend_on_what_was_imported_first():
    """transformers patches `logging.Logger.warning_advice` onto the stdlib's Logger when it is
    imported; that method is not the stdlib's and must not enter the set (it would shift every
    later prompt's id between a process that loaded a tokenizer first and one that did not)."""
    import logging

    import transformers  # noqa: F401  (the import that patches Logger)

    assert hasattr(logging.Logger, "warning_advice")  # else this test checks nothing
    texts = [first_user_text(p) for p in load_prompts("code-stdlib-extra")]
    assert not any("warning_advice" in text for text in texts)
    assert any("`Logger." in text for text in texts)  # the stdlib's own Logger methods stay


def chat_rows(tokenizer, count: int) -> list[dict]:
    """Rows as datagen writes them for the first `count` T0 prompts, each answered by EOS."""
    from dspark_trt.runtime.chat import encode_chat

    rows = []
    for prompt in load_prompts("t0", count):
        answer = tokenizer(f"Answer to {prompt.prompt_id}.", add_special_tokens=False).input_ids
        rows.append({"id": prompt.prompt_id, "domain": "chat", "temperature": 0.0,
                     "prompt_ids": encode_chat(tokenizer, prompt.messages), "finish_reason": "stop",
                     "response_ids": answer + [tokenizer.eos_token_id]})
    return rows


@pytest.fixture(scope="module")
def tokenizer(default_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_folder)


def test_follow_ups_are_second_turns_after_training_chat_answers_only(tokenizer):
    """Every training chat row that ended by EOS gets `per_row` second turns: its own first turn,
    the target's answer, then a generic question; held-out rows (their prompt must never reach
    training), cut answers and other domains get none."""
    from dspark_trt.training.trainer import is_held_out

    rows = chat_rows(tokenizer, 80)
    rows[1]["finish_reason"] = "length"
    rows[2]["domain"] = "math"
    held_out = [row["id"] for row in rows if is_held_out(row["id"])]
    assert held_out  # else the split is not exercised
    kept = [row for i, row in enumerate(rows) if i not in (1, 2) and row["id"] not in held_out]
    prompts = follow_up_prompts(rows, tokenizer, per_row=2)
    assert [p.prompt_id for p in prompts] == [f"followup/{row['id']}/{turn}" for row in kept for turn in (0, 1)]
    t0 = {p.prompt_id: p.messages for p in load_prompts("t0", 80)}
    for index, prompt in enumerate(prompts):
        row = kept[index // 2]
        first, answer, question = prompt.messages[:-2], prompt.messages[-2], prompt.messages[-1]
        assert first == t0[row["id"]] and prompt.domain == "chat"
        assert answer == {"role": "assistant", "content": f"Answer to {row['id']}."}
        assert question["role"] == "user" and question["content"] in FOLLOW_UPS
    # datagen cycles temperatures 0, 1 by position: every question is asked at both
    for parity in (0, 1):
        assert {p.messages[-1]["content"] for p in prompts[parity::2]} == set(FOLLOW_UPS)
    assert all(a.messages[-1] != b.messages[-1] for a, b in zip(prompts[::2], prompts[1::2], strict=True))
    one_each = follow_up_prompts(rows, tokenizer)
    assert [p.prompt_id for p in one_each] == [f"followup/{row['id']}/0" for row in kept]
    for parity in (0, 1):
        assert {p.messages[-1]["content"] for p in one_each[parity::2]} == set(FOLLOW_UPS)


def test_follow_ups_refuse_rows_from_another_set_or_tokenizer(tokenizer):
    rows = chat_rows(tokenizer, 3)
    wrong_ids = [dict(rows[0], prompt_ids=rows[0]["prompt_ids"][:-1])]
    with pytest.raises(DsparkError, match="t0/0.*prompt_ids are not t0's prompt 0"):
        follow_up_prompts(wrong_ids, tokenizer)
    evaluation = [dict(rows[0], id="mt-bench/0")]
    with pytest.raises(DsparkError, match="'mt-bench/0' is not from a training prompt set"):
        follow_up_prompts(evaluation, tokenizer)


def test_datagen_follow_up_writes_second_turns_alone(tiny_llama, tokenizer, tmp_path):
    """`datagen --follow-up DATA` generates the second turns only (no default prompt mix), with
    prompts that hold the first turn's ids and the answer, resumably."""
    from click.testing import CliRunner

    from dspark_trt.cli import main

    data = tmp_path / "rows.jsonl"
    rows = [row for row in chat_rows(tokenizer, 30) if len(row["prompt_ids"]) < 150 and follow_up_prompts([row], tokenizer)]
    rows = rows[:5]  # the tiny target's context is 256 tokens
    assert len(rows) >= 3
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "followup.jsonl"
    command = ["datagen", "--target", str(tiny_llama), "--follow-up", str(data), "--output", str(output),
               "--max-tokens", "3", "--max-prompt-tokens", "200", "--batch-size", "4", "--device", "cpu"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["id"] for r in written) == sorted(f"followup/{row['id']}/0" for row in rows)
    by_id = {row["id"]: row for row in rows}
    for row in written:
        first = by_id[row["id"].split("/", 1)[1].rsplit("/", 1)[0]]
        answer = first["response_ids"][:-1]
        assert row["prompt_ids"][: len(first["prompt_ids"]) - 2] == first["prompt_ids"][:-2]  # the first turn
        assert any(row["prompt_ids"][i:i + len(answer)] == answer for i in range(len(row["prompt_ids"])))
        assert row["domain"] == "chat" and 1 <= len(row["response_ids"]) <= 3
    again = CliRunner().invoke(main, command)
    assert again.exit_code == 0 and "wrote 0 new rows" in again.output


def test_resamples_ask_training_prompts_again_at_the_other_temperature(tokenizer):
    """A second response to each training row: its own conversation, the other temperature of
    the pair (greedy <-> 1), id `resample/<row id>`; held-out rows are skipped."""
    from dspark_trt.training.trainer import is_held_out

    rows = chat_rows(tokenizer, 80)
    for index, row in enumerate(rows):
        row["temperature"] = float(index % 2)
    rows[3]["domain"] = "math"  # the domain travels with the row
    kept = [row for row in rows if not is_held_out(row["id"])]
    assert len(kept) < len(rows)  # else the split is not exercised
    prompts = resample_prompts(rows, tokenizer)
    assert [p.prompt_id for p in prompts] == [f"resample/{row['id']}" for row in kept]
    t0 = {p.prompt_id: p.messages for p in load_prompts("t0", 80)}
    for prompt, row in zip(prompts, kept, strict=True):
        assert prompt.messages == t0[row["id"]] and prompt.domain == row["domain"]
        assert prompt.temperature == 1.0 - row["temperature"]


def test_resamples_refuse_rows_they_cannot_rebuild(tokenizer):
    rows = chat_rows(tokenizer, 3)
    with pytest.raises(DsparkError, match="resample: row 't0/0'.*prompt_ids are not t0's prompt 0"):
        resample_prompts([dict(rows[0], prompt_ids=rows[0]["prompt_ids"][1:])], tokenizer)
    with pytest.raises(DsparkError, match="resample: row 'followup/t0/0/0' is not from a training prompt set"):
        resample_prompts([dict(rows[0], id="followup/t0/0/0")], tokenizer)


def test_resamples_ask_the_rows_own_prompt_even_where_a_memory_address_changed(tokenizer):
    """A few stdlib signatures print a default as `<function copy2 at 0x7f...>`, whose address
    differs between processes: such a row is still resampled, with its own prompt ids; any other
    difference is refused."""
    import re

    from dspark_trt.runtime.chat import encode_chat
    from dspark_trt.training.trainer import is_held_out

    prompt = next(p for p in load_prompts("code-stdlib")
                  if " at 0x" in first_user_text(p) and not is_held_out(p.prompt_id))
    moved = [dict(m, content=re.sub(r" at 0x[0-9a-f]+", " at 0x1234abcd", m["content"])) for m in prompt.messages]
    row = {"id": prompt.prompt_id, "domain": "code", "temperature": 1.0, "finish_reason": "stop",
           "prompt_ids": encode_chat(tokenizer, moved), "response_ids": [1, 2]}
    assert row["prompt_ids"] != encode_chat(tokenizer, prompt.messages)  # else nothing is exercised
    (resample,) = resample_prompts([row], tokenizer)
    assert resample.prompt_ids == row["prompt_ids"] and resample.temperature == 0.0
    changed = [dict(m, content=m["content"].replace("Write", "Draft")) for m in moved]
    with pytest.raises(DsparkError, match="prompt_ids are not code-stdlib's prompt"):
        resample_prompts([dict(row, prompt_ids=encode_chat(tokenizer, changed))], tokenizer)


def test_a_resample_is_held_out_with_the_row_it_came_from():
    """The split follows the prompt: hashing `resample/<id>` itself would send ~5% of held-out
    prompts into training through their second response."""
    import hashlib

    from dspark_trt.training.trainer import is_held_out

    ids = [f"t0/{i}" for i in range(400)]
    own_split = [int(hashlib.sha256(f"resample/{i}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < 0.05 for i in ids]
    assert own_split != [is_held_out(i) for i in ids]  # else this test could not fail
    assert [is_held_out(f"resample/{i}") for i in ids] == [is_held_out(i) for i in ids]
    assert any(is_held_out(i) for i in ids)


def test_datagen_resample_writes_second_responses_at_the_other_temperature(tiny_llama, tokenizer, tmp_path):
    """`datagen --resample DATA --domain chat`: the file's chat rows' prompts again, the other
    temperature each, nothing else; resumable; a domain with no prompt is a usage error."""
    from click.testing import CliRunner

    from dspark_trt.cli import main
    from dspark_trt.training.trainer import is_held_out

    rows = [row for row in chat_rows(tokenizer, 30) if len(row["prompt_ids"]) < 150 and not is_held_out(row["id"])][:4]
    assert len(rows) == 4
    for index, row in enumerate(rows):
        row["temperature"] = float(index % 2)
    rows[3]["domain"] = "code"  # left out by --domain chat
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "resample.jsonl"
    command = ["datagen", "--target", str(tiny_llama), "--resample", str(data), "--domain", "chat",
               "--output", str(output), "--max-tokens", "3", "--max-prompt-tokens", "200", "--batch-size", "4",
               "--device", "cpu"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    written = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(written) == sorted(f"resample/{row['id']}" for row in rows[:3])
    for row in rows[:3]:
        again = written[f"resample/{row['id']}"]
        assert again["prompt_ids"] == row["prompt_ids"] and again["domain"] == "chat"
        assert again["temperature"] == 1.0 - row["temperature"]
    assert "wrote 0 new rows" in CliRunner().invoke(main, command).output
    math_only = CliRunner().invoke(main, [*command[:5], "--domain", "math", *command[7:]])
    assert math_only.exit_code == 2 and "no prompt of domain math" in math_only.output


def test_datagen_gives_every_prompt_set_each_temperature(tiny_llama, tmp_path):
    """Temperatures cycle within each set, not over the interleaved list: with a long and a short
    set, cycling over the list gave the short set's prompts one temperature only."""
    from click.testing import CliRunner

    from dspark_trt.cli import main

    output = tmp_path / "rows.jsonl"
    result = CliRunner().invoke(main, ["datagen", "--target", str(tiny_llama), "--prompts", "gsm8k-train:6",
                                       "--prompts", "t0:2", "--output", str(output), "--max-tokens", "2",
                                       "--max-prompt-tokens", "200", "--batch-size", "8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r["temperature"] for r in map(json.loads, output.read_text().splitlines())}
    assert {row_id: rows[row_id] for row_id in ("t0/0", "t0/1")} == {"t0/0": 0.0, "t0/1": 1.0}
    assert [rows[f"gsm8k-train/{i}"] for i in range(6)] == [0.0, 1.0] * 3
