"""Prompt sets: training prompts never come from evaluation sets, and built sets are stable."""

import gzip
import json

from dspark_trt.training.prompts import (
    DATA_DIR,
    EVALUATION_SETS,
    TRAINING_SETS,
    load_prompts,
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
