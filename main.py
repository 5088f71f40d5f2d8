"""Placeholder demo until the end-to-end job lands: encode a rollout and show its trained tokens."""

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_rollout
from SimpleTorchLLMRL.tiny import tiny_tokenizer


def main():
    tok = tiny_tokenizer("chatml")
    r = Rollout([Message("You are helpful.", MessageType.SYSTEM), Message("What is 7 * 8?"),
                 Message("\\boxed{56}", MessageType.MODEL)])
    enc = encode_rollout(r, tok)
    print(tok.decode(enc.input_ids))
    print("trained:", repr(tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])))


if __name__ == "__main__":
    main()
