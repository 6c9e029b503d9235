#!/usr/bin/env python3
"""Writes tests/data/chat/{train,heldout}.jsonl: small chat corpora for the data.train test
(tests/train_text_test.sh). train.jsonl: 40 short conversations in OpenAI `messages` form and in
ShareGPT `conversations` form, some prompt-only (no assistant turn), some multi-turn, some with a
system prompt, two with reasoning. heldout.jsonl: 8 prompt-only conversations not in train.jsonl.
Deterministic (no randomness): run it again to get the same files.
    python3 tests/reference/make_chat_jsonl.py tests/data/chat
"""
import json
import os
import sys

TOPICS = ["the sea", "a small garden", "the old city", "rain in the morning", "a long road", "the night sky",
          "a red house", "the first snow", "a quiet room", "the river", "a good book", "the market",
          "a cold winter", "the open field", "a new school", "the mountain"]
ASKS = ["Tell me about {t}.", "Write two lines about {t}.", "What do you think of {t}?", "Give me a short story about {t}.",
        "Why do people like {t}?"]
ANSWERS = ["{T} is a place where time moves slowly, and the light changes every hour.",
           "Many people find {t} calm. It gives them a moment to think.",
           "Here is a short one: we walked to {t}, and we stayed there until the day was over.",
           "I think {t} is beautiful, but it can also be hard when the weather turns.",
           "People like {t} because it reminds them of home and of the people they love."]
FOLLOW = ["Can you make it shorter?", "And what about at night?", "Thank you. One more, please."]
FOLLOW_ANS = ["Sure: {t}, quiet and bright.", "At night {t} is dark and still, and you can hear every sound.",
              "Of course: the end of the day came to {t}, and everyone went home."]
SYSTEMS = ["You are a helpful assistant.", "You answer in plain and simple English."]


def cap(s):
    return s[0].upper() + s[1:]


def conversation(i):
    t = TOPICS[i % len(TOPICS)]
    ask = ASKS[i % len(ASKS)].format(t=t)
    ans = ANSWERS[(i // 2) % len(ANSWERS)].format(t=t, T=cap(t))
    kind = i % 5  # 0 prompt-only, 1 one turn, 2 multi-turn, 3 system + one turn, 4 system + multi-turn
    msgs = []
    if kind in (3, 4) or (kind == 0 and i % 2):
        msgs.append({"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]})
    msgs.append({"role": "user", "content": ask})
    if kind == 0:
        return msgs
    a = {"role": "assistant", "content": ans}
    if i in (7, 23):  # reasoning, as the Qwen3.5 template takes it
        a["reasoning_content"] = "The user wants something about " + t + ". Keep it short."
    msgs.append(a)
    if kind in (2, 4):
        j = i % len(FOLLOW)
        msgs += [{"role": "user", "content": FOLLOW[j]}, {"role": "assistant", "content": FOLLOW_ANS[j].format(t=t)}]
    return msgs


def sharegpt(msgs):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}


def main(out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train.jsonl"), "w") as f:
        for i in range(40):
            msgs = conversation(i)
            # Every third row in ShareGPT form (without reasoning, which that form does not carry).
            row = sharegpt(msgs) if i % 3 == 2 and not any("reasoning_content" in m for m in msgs) else {"messages": msgs}
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(out, "heldout.jsonl"), "w") as f:
        for i in range(8):
            t = ["a warm summer", "the library", "a busy street", "the lake", "an old friend", "the forest",
                 "a train station", "the harbour"][i]
            f.write(json.dumps({"messages": [{"role": "user", "content": ASKS[i % len(ASKS)].format(t=t)}]}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/chat")
