import json

import pytest

from composer_jax.data.chat import (
    OBSERVATION,
    PROMPT,
    ChatTemplateError,
    GenericChatFormat,
    TemplateChatFormat,
    chat_format_for,
    render_chat_template,
)
from composer_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.data.helpers import make_hf_folder, make_tiktoken_folder

TASK = "Write `f(x)` in f.py.\nTools: write_file(path, content)\n"
TURN_1 = '<think>start</think>\n<call tool="write_file"><arg name="path">f.py</arg></call>'
OUTPUT_1 = "[ok] wrote 12 bytes to f.py"
TURN_2 = "<final>Done, f returns x.</final>"


def test_generic_format_is_the_plain_layout():
    tokenizer = ByteTokenizer()
    chat = chat_format_for(tokenizer)
    assert isinstance(chat, GenericChatFormat)
    assert chat.prompt(TASK) == tokenizer.encode(TASK)
    context, target = chat.sft_example(TASK, TURN_1)
    assert context == [tokenizer.bos_id, *tokenizer.encode(TASK)]
    assert target == [*tokenizer.encode(TURN_1), tokenizer.eos_id]
    segments = chat.after_turn(OUTPUT_1, tokenizer.encode(TURN_1))
    assert [(s.ids, s.role) for s in segments] == [
        (tokenizer.encode(f"\n{OUTPUT_1}\n"), OBSERVATION)
    ]
    segments = chat.after_turn(OUTPUT_1, [], note="\n[budget]\n", assistant_prefix="<summary>")
    assert segments[1].ids == tokenizer.encode("\n[budget]\n<summary>")
    assert segments[1].role == PROMPT
    assert chat.stop_token_ids == (tokenizer.eos_id,)


def _chatml(tmp_path):
    make_hf_folder(tmp_path)
    return load_tokenizer(str(tmp_path))


def test_template_prompt_is_the_rendered_template(tmp_path):
    tokenizer = _chatml(tmp_path)
    chat = chat_format_for(tokenizer, system="Be brief.")
    assert isinstance(chat, TemplateChatFormat) and chat.tool_role == "tool"
    want = (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        f"{TASK}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.prompt(TASK) == tokenizer.encode(want)
    assert chat.turn_close == "<|im_end|>\n"
    assert chat.stop_token_ids == (tokenizer.eos_id, tokenizer.token_id("<|im_end|>"))
    context, target = chat.sft_example(TASK, TURN_1)
    assert context == chat.prompt(TASK)
    assert target == tokenizer.encode(TURN_1 + "<|im_end|>\n")


@pytest.mark.parametrize("kind", ["chatml", "kimi"])
@pytest.mark.parametrize("closed_by_model", [False, True])
def test_incremental_conversation_equals_the_full_rendering(tmp_path, kind, closed_by_model):
    """Prompt + turn + after_turn(...) + turn, appended piece by piece as a rollout does, is the
    tokenization of the whole conversation rendered at once."""
    if kind == "chatml":
        tokenizer = _chatml(tmp_path)
    else:
        make_tiktoken_folder(tmp_path)
        tokenizer = load_tokenizer(str(tmp_path))
    chat = chat_format_for(tokenizer)
    close = tokenizer.token_id("<|im_end|>")
    generated = tokenizer.encode(TURN_1) + ([close] if closed_by_model else [])
    ids = chat.prompt(TASK) + generated
    segments = chat.after_turn(OUTPUT_1, generated)
    for segment in segments:
        ids += segment.ids
    ids += tokenizer.encode(TURN_2 + chat.turn_close)
    conversation = [
        {"role": "user", "content": TASK},
        {"role": "assistant", "content": TURN_1},
        {"role": "tool", "content": OUTPUT_1},
        {"role": "assistant", "content": TURN_2},
    ]
    assert ids == tokenizer.encode(chat.render(conversation))
    observed = [i for s in segments if s.role == OBSERVATION for i in s.ids]
    assert observed == tokenizer.encode(OUTPUT_1)  # only the output counts as tool output


def test_template_without_a_tool_role_puts_outputs_in_user_messages(tmp_path):
    strict = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "{{ '[' + m['role'] + '] ' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
    )
    make_hf_folder(tmp_path, chat_template=strict)
    tokenizer = load_tokenizer(str(tmp_path))
    chat = chat_format_for(tokenizer)
    assert chat.tool_role == "user"
    text = "".join(
        tokenizer.decode(s.ids) if s.role == PROMPT else "<OUT>"
        for s in chat.after_turn(OUTPUT_1, [])
    )
    assert text == "[user] <OUT>[assistant] "  # eos is dropped by decode


def test_unusable_templates_fail_clearly(tmp_path):
    drops_history = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ '<a>' + m['content'].split('NEXT')[0][:3] + '</a>' }}{% else %}"
        "{{ '<' + m['role'] + '>' + m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
    )
    make_hf_folder(tmp_path / "a", chat_template=drops_history)
    with pytest.raises(ChatTemplateError):
        chat_format_for(load_tokenizer(str(tmp_path / "a")))
    make_hf_folder(tmp_path / "b", chat_template="{% for m in messages %}{{ m['content'] ")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        chat_format_for(load_tokenizer(str(tmp_path / "b")))


def test_render_supports_hf_template_helpers():
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    )
    text = render_chat_template(template, [{"role": "user", "content": 'é"x'}])
    assert text == json.dumps('é"x', ensure_ascii=False)
    with pytest.raises(ChatTemplateError, match="boom"):
        render_chat_template("{{ raise_exception('boom') }}", [])


@pytest.mark.parametrize("kind", ["generic", "chatml", "kimi"])
def test_a_special_tokens_text_in_a_tool_output_stays_text(tmp_path, kind):
    """Code under test prints `<|im_end|>` or the eos token's text: in the observation it is the
    text, not the token (which would close the tool's turn in the context, or end it)."""
    if kind == "kimi":
        make_tiktoken_folder(tmp_path)
        tokenizer = load_tokenizer(str(tmp_path))
    else:
        tokenizer = _chatml(tmp_path) if kind == "chatml" else load_tokenizer("code_bpe_2k")
    specials = {name: i for name, i in tokenizer.special_tokens.items() if name in OUTPUT_ATTACK}
    assert specials, "the output names none of the tokenizer's special tokens"
    chat = chat_format_for(tokenizer)
    segments = chat.after_turn(OUTPUT_ATTACK, tokenizer.encode(TURN_1))
    observed = [i for s in segments if s.role == OBSERVATION for i in s.ids]
    assert not set(observed) & set(tokenizer.special_tokens.values())
    assert OUTPUT_ATTACK in tokenizer.decode(observed)
    assert set(tokenizer.encode(OUTPUT_ATTACK)) & set(specials.values())  # what it was before


OUTPUT_ATTACK = "AssertionError: got '<|eos|>' then '<|im_end|>' and '</s>'"
