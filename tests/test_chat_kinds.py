"""The loss-mask convention on each kind of template and row that used to be skipped or mis-masked: assistant-first
rows, templates that append an end-of-text or write the assistant header in the user turn, string tool-call
arguments, `{% generation %}` blocks that disagree, a separator after the header, no end-of-turn token, per-turn
weights (tests/chat_templates.py holds the templates, each written like its family's).

Every expected mask is written by hand from the rendered text, as the exact strings of the runs of supervised tokens;
the token ids are checked against `apply_chat_template(tokenize=True)` on messages written out by hand.
"""

from __future__ import annotations

import json
import logging

import chat_templates as T
import pytest
from test_chat import PLAIN, ROW, TOOLS, family_tokenizer, supervised_runs

from dflash_prep.data import chat, rows

FIRST = {"messages": [{"role": "assistant", "content": "Hello! Ask me anything."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4."}]}
SYSTEM_FIRST = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi there."},
                             {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}
ONLY = {"messages": [{"role": "assistant", "content": "Hello!"}]}


def renderer(family: str, template: str, stops: tuple[str, ...] = ()):
    tokenizer = family_tokenizer(family)
    stop_ids = [tokenizer.convert_tokens_to_ids(s) for s in stops]
    return tokenizer, chat.ChatRenderer(tokenizer, template, {}, stop_ids)


def runs_of(family: str, template: str, row: dict, stops: tuple[str, ...] = ()) -> list[str]:
    tokenizer, r = renderer(family, template, stops)
    out = r.tokenize_conversation(chat.read_conversation(row))
    messages, tools = chat.row_to_chat(row)
    reference = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                              return_dict=True)["input_ids"]
    assert out.input_ids == list(reference)
    return supervised_runs(tokenizer, out.input_ids, out.loss_mask)


# ------------------------------------------------------------------------------------------ assistant-first rows
ASSISTANT_FIRST = {  # family: (template, the supervised text of FIRST, SYSTEM_FIRST and ONLY, by hand)
    "qwen3": (T.QWEN3, ["Hello! Ask me anything.<|im_end|>", "<think>\n\n</think>\n\n4.<|im_end|>"],
              ["Hi there.<|im_end|>", "<think>\n\n</think>\n\n4.<|im_end|>"], ["Hello!<|im_end|>"]),
    "llama31": (T.LLAMA31, ["Hello! Ask me anything.<|eot_id|>", "4.<|eot_id|>"],
                ["Hi there.<|eot_id|>", "4.<|eot_id|>"], ["Hello!<|eot_id|>"]),
    "mistral": (T.MISTRAL, ["Hello! Ask me anything.</s>", "4.</s>"], ["Hi there.</s>", "4.</s>"], ["Hello!</s>"]),
    # the generation prompt opens <think>; an earlier turn renders `</think>` alone, which is generated
    "deepseek": (T.DEEPSEEK, ["</think>Hello! Ask me anything.<｜end▁of▁sentence｜>",
                              "</think>4.<｜end▁of▁sentence｜>"],
                 ["</think>Hi there.<｜end▁of▁sentence｜>", "</think>4.<｜end▁of▁sentence｜>"],
                 ["</think>Hello!<｜end▁of▁sentence｜>"]),
    "gpt_oss": (T.GPT_OSS, ["<|channel|>final<|message|>Hello! Ask me anything.<|end|>",
                            "<|channel|>final<|message|>4.<|return|>"],
                ["<|channel|>final<|message|>Hi there.<|end|>", "<|channel|>final<|message|>4.<|return|>"],
                ["<|channel|>final<|message|>Hello!<|return|>"]),
    "phi": (T.PHI, ["Hello! Ask me anything.<|end|>", "4.<|end|>"], ["Hi there.<|end|>", "4.<|end|>"],
            ["Hello!<|end|>"]),
    # the space after [/INST] (here after nothing) is a separator the model generates
    "llama2": (T.LLAMA2, [" Hello! Ask me anything. </s>", " 4. </s>"], [" Hi there. </s>", " 4. </s>"],
               [" Hello! </s>"]),
}


@pytest.mark.parametrize("family", sorted(ASSISTANT_FIRST))
def test_an_assistant_turn_before_any_user_turn_is_kept_and_masked(family):
    template, first, system_first, only = ASSISTANT_FIRST[family]
    assert runs_of(family, template, FIRST) == first
    assert runs_of(family, template, SYSTEM_FIRST) == system_first
    assert runs_of(family, template, ONLY) == only


def test_qwen36s_assistant_first_row_whose_opening_turn_renders_only_beside_a_user_turn():
    """Qwen3.5/3.6's released templates refuse a conversation without a user query: the opening assistant turn
    renders neither alone nor before a probe reply; its end is read before a probe user turn."""
    assert runs_of("qwen36", T.QWEN36_STRICT, FIRST) == ["Hello! Ask me anything.<|im_end|>",
                                                         "\n</think>\n\n4.<|im_end|>"]
    assert runs_of("qwen36", T.QWEN36_STRICT, SYSTEM_FIRST) == ["Hi there.<|im_end|>", "\n</think>\n\n4.<|im_end|>"]


def test_no_end_of_turn_token_and_no_generation_config_warns_once_naming_the_file(tmp_path, caplog):
    tokenizer = family_tokenizer("glm4")
    tokenizer.chat_template = T.GLM4
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    fn = rows.Tokenizer(tokenizer=AutoTokenizer.from_pretrained(tmp_path), max_length=4096, overlong="skip",
                        vocab_size=100000)
    with caplog.at_level(logging.WARNING, logger="dflash_prep.data.chat"):
        for _ in range(2):
            assert not fn.process_row(PLAIN).reason
    warned = [m for m in caplog.messages if "no end-of-turn token" in m]
    assert len(warned) == 1 and str(tmp_path / "generation_config.json") in warned[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [
        tokenizer.convert_tokens_to_ids(t) for t in T.STOP_TOKENS["glm4"]]}))
    caplog.clear()
    chat._LOGGED_ONCE.clear()
    fn = rows.Tokenizer(tokenizer=AutoTokenizer.from_pretrained(tmp_path), max_length=4096, overlong="skip",
                        vocab_size=100000)
    with caplog.at_level(logging.WARNING, logger="dflash_prep.data.chat"):
        assert not fn.process_row(PLAIN).reason
    assert not [m for m in caplog.messages if "no end-of-turn token" in m]


def test_a_template_that_refuses_an_assistant_first_row_skips_it_with_its_own_error():
    tokenizer, r = renderer("gemma", T.GEMMA)
    with pytest.raises(chat.SkipRow) as e:
        r.tokenize_conversation(chat.read_conversation(FIRST))
    assert e.value.reason == chat.TEMPLATE_ERROR
    assert e.value.detail == "TemplateError: Conversation roles must alternate user/assistant/user/assistant/..."


# ------------------------------------------------------------------------------------------ end-of-text, header
def test_templates_that_append_an_end_of_text_do_not_supervise_it():
    """Phi-3.5 and Phi-4-mini end a conversation rendered without a generation prompt with <|endoftext|>: the
    rendering of the turns before a reply is then no prefix of the whole conversation's."""
    stops = ("<|endoftext|>", *T.STOP_TOKENS["phi"])
    plain = ["4 — facile.<|end|>", "9.<|end|>", "De rien ! 😊<|end|>"]
    for template in (T.PHI35, T.PHI4_MINI):
        tokenizer, r = renderer("phi", template, stops)
        out = r.tokenize_conversation(chat.read_conversation(PLAIN))
        assert tokenizer.decode(out.input_ids).endswith("De rien ! 😊<|end|>" + ("\n" if template == T.PHI35 else "")
                                                        + "<|endoftext|>")
        assert runs_of("phi", template, PLAIN, stops) == plain
        assert runs_of("phi", template, FIRST, stops) == ["Hello! Ask me anything.<|end|>", "4.<|end|>"]
        assert runs_of("phi", template, ONLY, stops) == ["Hello!<|end|>"]


def test_a_template_that_writes_the_assistant_header_in_the_user_turn():
    """Phi-3-mini's first template: `<|assistant|>\\n` closes the user turn; a reply is its text and <|end|>."""
    tokenizer, r = renderer("phi", T.PHI3_MINI)
    out = r.tokenize_conversation(chat.read_conversation(PLAIN))
    assert tokenizer.decode(out.input_ids).startswith("<|user|>\nQu'est-ce que 2+2 ?<|end|>\n<|assistant|>\n4 — ")
    assert runs_of("phi", T.PHI3_MINI, PLAIN) == ["4 — facile.<|end|>", "9.<|end|>", "De rien ! 😊<|end|>"]
    assert runs_of("phi", T.PHI3_MINI, SYSTEM_FIRST) == ["Hi there.<|end|>", "4.<|end|>"]  # system not rendered


# ------------------------------------------------------------------------------------------ tool-call arguments
def test_a_template_that_concatenates_arguments_gets_them_as_the_data_holds_them_for_every_row():
    """DeepSeek-V3 adds `function.arguments` to a string (an object makes it fail) and tests a null content with
    `is none` (transformers drops a None value, so "" is what renders): arguments stored as a JSON string keep their
    exact text, arguments stored as an object are serialized; the reply after tool outputs has no header."""
    as_text = json.loads(json.dumps(ROW))
    as_text["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"city":"Zürich"}'  # no space: kept as is
    as_object = json.loads(json.dumps(ROW))
    as_object["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"city": "Zürich"}
    tokenizer, r = renderer("deepseek_v3", T.DEEPSEEK_V3)
    assert r.tool_call_form == ("string", "")
    for row, arguments in ((as_text, '{"city":"Zürich"}'), (as_object, '{"city": "Zürich"}')):
        out = r.tokenize_conversation(chat.read_conversation(row))
        assert supervised_runs(tokenizer, out.input_ids, out.loss_mask) == [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + arguments
            + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
            "It is 21 °C in Zürich.<｜end▁of▁sentence｜>", "東京: no data yet.<｜end▁of▁sentence｜>"]
        messages = [ROW["messages"][0], ROW["messages"][1],
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "get_weather", "arguments": arguments}}]},
                    *ROW["messages"][3:]]
        reference = tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=T.DEEPSEEK_V3, tokenize=True,
                                                  return_dict=True)["input_ids"]
        assert out.input_ids == list(reference) and out.renders_tool_calls and not out.renders_reasoning
    assert renderer("qwen3", T.QWEN3)[1].tool_call_form == ("object", None)  # a template that takes objects


# ------------------------------------------------------------------------------------------ {% generation %} hint
@pytest.mark.parametrize("template, extra", [(T.CHATML_TAGGED_HEADER, "'<|im_start|>', 'assistant', '\\n'"),
                                             (T.CHATML_TAGGED_NEWLINE, "'\\n', '\\n', '\\n'")])
def test_generation_blocks_that_disagree_with_the_convention_are_logged_once_and_not_followed(template, extra,
                                                                                              caplog):
    """One template's blocks wrap the role header, the other's the newline after <|im_end|>: transformers' mask
    supervises those; the convention does not."""
    chat._LOGGED_ONCE.clear()
    tokenizer, r = renderer("qwen3", template)
    transformers_mask = tokenizer.apply_chat_template(PLAIN["messages"], chat_template=template, tokenize=True,
                                                      return_dict=True, return_assistant_tokens_mask=True)
    with caplog.at_level(logging.WARNING, logger="dflash_prep.data.chat"):
        for row in (PLAIN, PLAIN, SYSTEM_FIRST):
            out = r.tokenize_conversation(chat.read_conversation(row))
    assert out.input_ids != [] and supervised_runs(tokenizer, *_ids_mask(r, PLAIN)) == [
        "4 — facile.<|im_end|>", "9.<|im_end|>", "De rien ! 😊<|im_end|>"]
    assert sum(transformers_mask["assistant_masks"]) > sum(_ids_mask(r, PLAIN)[1])  # the blocks do disagree
    warnings = [m for m in caplog.messages if "{% generation %}" in m]
    assert len(warnings) == 1 and extra in warnings[0]


def _ids_mask(r, row):
    out = r.tokenize_conversation(chat.read_conversation(row))
    return out.input_ids, out.loss_mask


# ------------------------------------------------------------------------------------------ separator
def test_the_separator_after_the_prompt_is_supervised_whether_or_not_it_is_a_token_of_its_own():
    """Llama-2 writes ' ' + reply after [/INST]: ' the' is one token of this tokenizer, ' Sure' is 'Ġ' + 'S'...; the
    space is supervised in both (the served model generates it after the prompt)."""
    tokenizer = family_tokenizer("llama2")
    assert tokenizer.tokenize(" the")[0] == "Ġthe" and tokenizer.tokenize(" Sure")[0] == "Ġ"
    row = {"messages": [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Sure."},
                        {"role": "user", "content": "And?"}, {"role": "assistant", "content": "the answer."}]}
    tokenizer, r = renderer("llama2", T.LLAMA2)
    out = r.tokenize_conversation(chat.read_conversation(row))
    assert tokenizer.decode(out.input_ids) == ("<s>[INST] Sure? [/INST] Sure. </s>"
                                               "<s>[INST] And? [/INST] the answer. </s>")
    assert supervised_runs(tokenizer, out.input_ids, out.loss_mask) == [" Sure. </s>", " the answer. </s>"]


# ------------------------------------------------------------------------------------------ no end-of-turn token
def test_without_an_end_of_turn_token_the_stop_token_the_model_generates_is_supervised():
    """GLM-4 ends a turn with the next role's token; its stop ids name <|user|> and <|observation|>. The last
    turn has nothing after it; a reply starts with a newline written after the <|assistant|> prompt."""
    stops = ("<|endoftext|>", *T.STOP_TOKENS["glm4"])
    assert runs_of("glm4", T.GLM4, ROW, stops) == [
        'get_weather\n{"city": "Zürich"}<|observation|>', "\nIt is 21 °C in Zürich.<|user|>", "\n東京: no data yet."]
    assert runs_of("glm4", T.GLM4, FIRST, stops) == ["\nHello! Ask me anything.<|user|>", "\n4."]
    assert runs_of("glm4", T.GLM4, PLAIN, ()) == ["\n4 — facile.", "\n9.", "\nDe rien ! 😊"]  # no stop ids known


def test_the_stop_ids_come_from_the_checkpoints_generation_config(tmp_path):
    tokenizer = family_tokenizer("glm4")
    tokenizer.save_pretrained(tmp_path)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|user|>", "<|observation|>")]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0] + ids}))
    from transformers import AutoTokenizer

    assert rows.stop_token_ids_of(AutoTokenizer.from_pretrained(tmp_path)) == sorted({0, *ids})
    assert rows.stop_token_ids_of(family_tokenizer("glm4")) == [0]  # the demo folder has none: the eos token only


# ------------------------------------------------------------------------------------------ per-turn weight
def test_a_turn_with_weight_0_is_not_supervised_and_other_weights_skip_the_row_with_the_turn_named():
    row = {"messages": [{"role": "user", "content": "Q1", "weight": 0},
                        {"role": "assistant", "content": "Not this one.", "weight": 0},
                        {"role": "user", "content": "Q2"},
                        {"role": "assistant", "content": "This one.", "weight": 1},
                        {"role": "user", "content": "Q3"},
                        {"role": "assistant", "content": "And this.", "weight": True}]}
    assert runs_of("qwen3", T.QWEN3, row) == ["This one.<|im_end|>", "<think>\n\n</think>\n\nAnd this.<|im_end|>"]
    sharegpt = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "Skip me.", "weight": 0},
                                  {"from": "human", "value": "Q"}, {"from": "gpt", "value": "Keep me."}]}
    assert runs_of("llama31", T.LLAMA31, sharegpt) == ["Keep me.<|eot_id|>"]
    for turn, weight, detail in ((1, 0.5, "turn 1 has weight 0.5: a turn is trained (1) or not (0)"),
                                 (0, 1, "turn 0 (user) has weight 1: only assistant turns are supervised"),
                                 (1, "0", "turn 1 has weight '0': a turn is trained (1) or not (0)")):
        bad = json.loads(json.dumps(row))
        bad["messages"][turn]["weight"] = weight
        with pytest.raises(chat.SkipRow) as e:
            chat.read_conversation(bad)
        assert (e.value.reason, e.value.detail) == (chat.BAD_WEIGHT, detail)
