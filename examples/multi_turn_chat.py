"""A multi-turn chat whose history is reused exactly from the prefix cache."""

from kvboost_rag import KVBoost, KVBoostConfig

engine = KVBoost.from_pretrained("smollm2-135m-instruct", config=KVBoostConfig(fidelity="exact"))
messages = [{"role": "system", "content": "You are a concise assistant."}]
for question in ["Name a planet.", "How far is it from the Sun?", "And its moons?"]:
    messages.append({"role": "user", "content": question})
    result = engine.chat(messages, max_new_tokens=32)
    messages.append({"role": "assistant", "content": result.text})
    print(f"> {question}\n{result.text}")
    print(f"  ttft {result.ttft_ms:.0f} ms, reused {result.reused_tokens}/{result.prompt_tokens}")
