"""
formats/chat.py -- a chat model's own prompt format: its chat template, rendered as transformers
renders it, and the tokens that end its turn.

An instruct model was trained on conversations written one way: SmolLM2's and Qwen's as ChatML
("<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"), Llama 3's with its header tokens,
Llama 2's with [INST]. The model's authors ship that format as a Jinja template: a GGUF's
tokenizer.chat_template, a folder's tokenizer_config.json ("chat_template") or chat_template.jinja.
Given a question, the template writes the conversation up to where the assistant's answer begins
(add_generation_prompt); the model writes the answer and ends it with its end-of-turn token
(<|im_end|>, <|eot_id|>), where decoding stops.

Rendered in Jinja's sandbox with the options, filters and variables transformers'
apply_chat_template uses (trim_blocks, lstrip_blocks, loop controls; tojson without ASCII
escapes; raise_exception, strftime_now; the tokenizer's bos_token, eos_token, ... as text), and
encoded with no special token added around it (the template writes those itself).

    >>> chat = Chat("{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n"
    ...             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}",
    ...             tokens={}, stop=[2])
    >>> chat.render([{"role": "user", "content": "Hi"}])
    '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
"""

import datetime
import functools
import json
from dataclasses import asdict, dataclass, field

import jinja2  # torch's own dependency: there wherever torch is
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.checkpoint import CheckpointError

# the tokenizer's named tokens a template may write, as transformers passes them
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass
class Chat:
    """A model's chat format: its template (Jinja source), the named tokens it may write
    ({"bos_token": "<s>", ...}) and the ids that end the model's turn (decoding stops at the
    first)."""
    template: str
    tokens: dict = field(default_factory=dict)
    stop: list = field(default_factory=list)

    def render(self, messages, add_generation_prompt=True):
        """The conversation `messages` ([{"role", "content"}]) as the model's text, ending where
        the assistant's turn begins."""
        try:
            return compiled(self.template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                documents=None, **self.tokens)
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
            raise CheckpointError(f"the model's chat template fails on this conversation "
                                  f"({type(e).__name__}: {str(e)[:120]})") from None

    def prompt(self, enc, question, system=None):
        """The token ids of one user turn (and a system turn, where given) ready for the answer:
        rendered, then encoded with nothing added around it."""
        turns = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": question}]
        return enc.encode_plain(self.render(turns))

    def to_dict(self):
        return asdict(self)

    @classmethod
    def of_target(cls, target_ckpt, path, flag):
        """The chat format out/target.pt keeps (an instruct model's, imported with --init-from),
        for `flag`; one line saying how to get one where it keeps none."""
        d = target_ckpt.get("chat")
        if not isinstance(d, dict):
            raise CheckpointError(f"{flag} needs a chat model, and {path} keeps no chat template "
                                  "(a target trained here, a base model, or one imported before "
                                  "chat formats were kept): import an instruct model with `python "
                                  "train.py --init-from smollm2 --only target` (or your own GGUF "
                                  "or folder; --force over an older import)")
        return cls(**d)


@functools.lru_cache(maxsize=8)
def compiled(template):
    """A template compiled as transformers compiles one."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, \
        ensure_ascii=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                       separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise CheckpointError(f"the model's chat template is not a template jinja2 reads "
                              f"({str(e)[:120]})") from None


def end_of_turn(template, tokens, specials):
    """The special token the template writes right after an assistant's answer: the model's
    end-of-turn mark ("<|im_end|>", "<|eot_id|>"), as {text: id}; {} where none follows it.
    Found by rendering a conversation and reading what comes after the answer."""
    chat = Chat(template, tokens)
    answer = "nanospec-answer"
    try:
        text = chat.render([{"role": "user", "content": "question"},
                            {"role": "assistant", "content": answer}], add_generation_prompt=False)
    except CheckpointError:
        return {}
    after = text[text.find(answer) + len(answer):] if answer in text else ""
    after = after.lstrip(" ")
    return {t: i for t, i in specials.items() if after.startswith(t)}


def chat_of(template, tokens, specials, eos_ids):
    """The Chat of a model: its template, its named tokens' texts, and what stops it: the
    end-of-sequence ids it declares and the template's end-of-turn token. None without a
    template (a base model: no chat format)."""
    if not template:
        return None
    if not isinstance(template, str):
        raise CheckpointError("the model's chat_template is not one template (a list of named "
                              "templates is not read)")
    compiled(template)  # a template that does not compile is refused now, not at the first chat
    stop = sorted({*eos_ids, *end_of_turn(template, tokens, specials).values()})
    return Chat(template, {k: v for k, v in tokens.items() if v is not None}, stop)
