""":class:`~tandem.text.tokenizer.Tokenizer` of the built-in presets: UTF-8 bytes plus four ids.

The vocabulary and the ``<image>`` rule are :mod:`tandem.tokenizer`'s (the model's
embedding table is sized from it); this class puts them behind the common interface and
gives the presets a small chat template, so ``messages`` requests work on them too.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem import tokenizer as byte_vocab
from tandem.text.chat_template import ChatMessage, ChatTemplate
from tandem.text.detokenizer import IncrementalDecoder, StreamDecoder
from tandem.text.tokenizer import ImageTokens, SpecialTokens

# One line per message, "role: content", images as the <image> marker.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_NAMES = {byte_vocab.PAD_ID: "<pad>", byte_vocab.BOS_ID: "<bos>", byte_vocab.EOS_ID: "<eos>",
          byte_vocab.IMAGE_ID: byte_vocab.IMAGE_MARKER}


class ByteTokenizer:
    vocab_size = byte_vocab.VOCAB_SIZE
    special = SpecialTokens(bos_id=byte_vocab.BOS_ID, eos_ids=(byte_vocab.EOS_ID,),
                            pad_id=byte_vocab.PAD_ID)
    image: ImageTokens | None = ImageTokens(byte_vocab.IMAGE_MARKER, byte_vocab.IMAGE_ID)

    def __init__(self) -> None:
        self._template = ChatTemplate(BUILTIN_CHAT_TEMPLATE, {}, "built-in chat template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = byte_vocab.encode(text)  # starts with BOS
        return ids if add_special_tokens else ids[1:]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(t for t in ids if 0 <= t < byte_vocab.NUM_BYTE_TOKENS).decode(
                "utf-8", "replace")
        out: list[str] = []
        run = bytearray()
        for t in ids:
            if 0 <= t < byte_vocab.NUM_BYTE_TOKENS:
                run.append(t)
            elif t in _NAMES:
                out.append(run.decode("utf-8", "replace"))
                run.clear()
                out.append(_NAMES[t])
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def incremental_decoder(self) -> IncrementalDecoder:
        return StreamDecoder(self.decode, _NAMES.keys())

    def render_chat(self, messages: Sequence[ChatMessage],
                    add_generation_prompt: bool = True) -> str:
        return self._template.render(messages, add_generation_prompt)
