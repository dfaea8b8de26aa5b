import pytest

from shardlm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", ["Hello world, this is a test.", "naïve café — 日本語のテキスト 🚀🎉 done",
                                  "  leading spaces\nand lines\n\n"])
def test_incremental_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for t in ids:
        before = d.output_text
        d.update([t])
        pieces.append(d.output_text[len(before):])
        assert "\ufffd" not in d.output_text       # never half a character
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_text(tokenizer):
    ids = tokenizer(" one two three four", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [1], stop=["three"])
    hit = None
    for t in ids:
        hit = hit or d.update([t])
    assert hit == "three" and d.output_text == " one two "
    d2 = IncrementalDetokenizer(tokenizer, [1], stop=["three"], include_stop_str_in_output=True)
    for t in ids:
        if d2.update([t]):
            break
    assert d2.output_text == " one two three"


def test_stop_string_across_tokens_and_holdback(tokenizer):
    d = IncrementalDetokenizer(tokenizer, [1], stop=["END!"])
    ids = tokenizer(" go EN", add_special_tokens=False).input_ids
    d.update(ids)
    assert d.output_text.endswith("EN")
    assert not d.visible_text(finished=False).endswith("EN")   # may begin the stop string
    assert d.visible_text(finished=True) == d.output_text
    hit = d.update(tokenizer("D!", add_special_tokens=False).input_ids)
    assert hit == "END!" and d.output_text == " go "


@pytest.mark.parametrize("text, stop, visible", [
    ("abc ST", ["STOP"], "abc "), ("abc SX", ["STOP"], "abc SX"), ("abc S", ["STOP", "xS"], "abc "),
    ("aaaa", ["aab"], "aa"), ("abab", ["abac"], "ab"), ("", ["x"], ""), ("end.", ["."], "end."),
    ("x" * 5000 + "ST", ["STOP", "S" * 200], "x" * 5000),
])
def test_running_text_holds_back_a_tail_that_may_begin_a_stop_string(tokenizer, text, stop, visible):
    d = IncrementalDetokenizer(tokenizer, [1], stop=stop)
    d.output_text = text
    assert d.visible_text(finished=False) == visible
    assert d.visible_text(finished=True) == text


@pytest.mark.parametrize("include_stop", [False, True])
def test_the_token_that_ends_the_output_shows_no_text_unless_asked(tokenizer, include_stop):
    """vLLM's rule: the EOS or stop token id that ended an output is not detokenized, so special
    tokens kept do not end the text with "<|im_end|>"; include_stop_str_in_output shows it."""
    ids = tokenizer(" one two", add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    d = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False, include_stop_str_in_output=include_stop)
    d.update(ids[:1])
    d.update(ids[1:], ends_with_stop_token=True)
    assert d.output_text == " one two" + ("<|im_end|>" if include_stop else "")
