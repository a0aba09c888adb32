"""An agent written with the plain OpenAI client, knowing nothing of slimen: it reads a problem on
stdin, asks the model, asks once more if the answer has no \\boxed{}, and prints the last answer.
agent() gives it OPENAI_BASE_URL and OPENAI_API_KEY, which OpenAI() reads."""

import sys

from openai import OpenAI

client = OpenAI()
messages = [{"role": "user", "content": sys.stdin.read()}]
for _ in range(2):
    reply = client.chat.completions.create(model="agent", messages=messages, max_tokens=24)
    answer = reply.choices[0].message.content
    if "\\boxed{" in answer:
        break
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "Answer with \\boxed{}."}]
print(answer)
